"""specheads.heads: draft head architectures, their config and checkpoint format."""

if __name__ != "specheads.heads":
    raise ImportError(
        f"this folder is the package 'specheads.heads' and cannot be imported as {__name__!r}; "
        "install specheads (pip install -e .) and use `import specheads.heads`"
    )

from specheads.heads.base import DraftHeads, TargetParts, check_heads_match_target
from specheads.heads.config import FIELD_HELP, HeadsConfig
from specheads.heads.dflash import DFlashHeads
from specheads.heads.eagle import EagleHeads
from specheads.heads.eagle3 import Eagle3Heads
from specheads.heads.medusa import MedusaHeads
from specheads.heads.mtp import MtpHeads

# One explicit registration line per head type.
HEAD_CLASSES: dict[str, type[DraftHeads]] = {
    "medusa": MedusaHeads,
    "eagle": EagleHeads,
    "eagle3": Eagle3Heads,
    "dflash": DFlashHeads,  # a block drafter: every depth in one forward (heads/dflash.py)
    "mtp": MtpHeads,  # the target's own MTP layer (heads/mtp.py): only for a target shipped with one
}
# The head types `create_heads` builds for any target.
HEAD_TYPES: tuple[str, ...] = ("medusa", "eagle", "eagle3", "dflash")

from specheads.heads.draft_model import DraftModelHeads, early_exit_model  # noqa: E402  (not a registered type)
from specheads.heads.loading import create_heads, load_heads  # noqa: E402  (needs HEAD_CLASSES)

__all__ = [
    "DFlashHeads",
    "DraftHeads",
    "DraftModelHeads",
    "Eagle3Heads",
    "EagleHeads",
    "FIELD_HELP",
    "HEAD_CLASSES",
    "HEAD_TYPES",
    "HeadsConfig",
    "MedusaHeads",
    "MtpHeads",
    "TargetParts",
    "check_heads_match_target",
    "create_heads",
    "early_exit_model",
    "load_heads",
]
