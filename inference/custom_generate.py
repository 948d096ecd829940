"""Heads usable from plain transformers: `target.generate(..., custom_generate="org/heads", trust_remote_code=True)`.

transformers runs `custom_generate/generate.py` of the repository named by `custom_generate` instead of its own
decoding loop. A heads checkpoint holding that file (`push_to_hub` writes it; so do `write_custom_generate` and
`specheads export --format transformers`) is therefore a drop-in speculative decoder for users who never import
specheads (it must be installed: the folder's requirements.txt says so, and transformers checks it):

    model = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
    out = model.generate(input_ids, max_new_tokens=128, custom_generate="org/smollm2-eagle", trust_remote_code=True)

The file is a shim naming where the heads live (the repository's id, or a local folder) and calling
`generate_with_heads`, which maps transformers' generate arguments onto `SpeculativeLM.generate`: outputs are the
target's own (greedy identical, sampling exact), and what the engine cannot do exactly is refused by name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

CUSTOM_GENERATE_DIR = "custom_generate"
# transformers.generate arguments that have no meaning for a heads speculator
UNSUPPORTED = {
    "assistant_model": "speculation here drafts with the heads, not an assistant model",
    "negative_prompt_ids": "classifier-free guidance is not applied by specheads",
    "negative_prompt_attention_mask": "classifier-free guidance is not applied by specheads",
    "assistant_tokenizer": "speculation here drafts with the heads, not an assistant model",
}
IGNORED = ("use_cache",)  # the engine always caches (outputs are unchanged)

SHIM = '''"""Speculative decoding with the specheads draft heads of this repository, as a transformers `custom_generate`.

    out = model.generate(input_ids, max_new_tokens=128, custom_generate="{location}", trust_remote_code=True)

Outputs are the model's own (greedy: identical tokens; sampling: the same distribution). `heads=` overrides where the
heads are read from; `stats={{}}` receives the run's statistics (new_tokens, target_forwards, mean_accepted).
"""

from specheads.inference.custom_generate import generate_with_heads

HEADS = {location!r}  # where these heads live (written by specheads)


def generate(model, heads=None, **kwargs):
    return generate_with_heads(model, heads or HEADS, **kwargs)
'''


def write_custom_generate(folder: str | os.PathLike, heads_location: str | os.PathLike | None = None) -> Path:
    """Write `folder/custom_generate/{generate.py, requirements.txt}` for heads saved in (or pushed from) `folder`.

    Args:
        folder: a heads checkpoint folder (`save_pretrained`).
        heads_location: where `generate.py` loads the heads from: the Hub id the folder is uploaded to, or (default)
            the folder's absolute path, for local use.

    Returns:
        The written `custom_generate` folder.
    """
    location = str(heads_location) if heads_location is not None else str(Path(folder).resolve())
    out = Path(folder) / CUSTOM_GENERATE_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / "generate.py").write_text(SHIM.format(location=location))
    from specheads import __version__

    (out / "requirements.txt").write_text(f"specheads>={__version__}\n")
    return out


def export_for_transformers(
    heads: str | os.PathLike, out_dir: str | os.PathLike, repo_id: str | None = None
) -> Path:
    """Copy a heads checkpoint (folder or Hub id; a Medusa-2 adapter subfolder included) to `out_dir` and add
    `custom_generate/` naming `repo_id` (the Hub id it will be uploaded to; the model card then names it too) or,
    by default, `out_dir` itself.

    Raises:
        FileNotFoundError / ValueError: `heads` is not a loadable specheads checkpoint.
    """
    import shutil

    from specheads import load_heads
    from specheads.heads.base import point_card_at
    from specheads.heads.loading import _resolve_folder

    source = _resolve_folder(heads, None, None, False)
    load_heads(source)  # a specheads checkpoint, complete and valid, before anything is written
    out = Path(out_dir)
    if out.resolve() != Path(source).resolve():
        shutil.copytree(source, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".*", CUSTOM_GENERATE_DIR))
    write_custom_generate(out, repo_id)
    if repo_id is not None:
        point_card_at(out, repo_id)
    return out


def generate_with_heads(
    model: PreTrainedModel, heads: str | os.PathLike, stats: dict[str, Any] | None = None, **arguments: Any
) -> Any:
    """Run `SpeculativeLM.generate` on `model` with the heads at `heads`, given transformers.generate's arguments.

    Args:
        model: the target (what transformers calls `generate` on).
        heads: a heads checkpoint folder or Hub id.
        stats: when given, updated with the run's `last_stats` (new_tokens, target_forwards, mean_accepted, ...).
        arguments: transformers.generate's arguments as `custom_generate` passes them (None for what the caller
            left out): `inputs` / `input_ids`, the generation settings, `generation_config`, processors, streamer,
            a vision-language target's images (`pixel_values`, ...). As in `SpeculativeLM.generate`,
            generation-config fields it has no argument for (`num_beams`, ...) go into a copy of the generation
            config, where the engine accepts or refuses them by name, and the rest are the prompt forward's inputs.

    Raises:
        ValueError: no prompt, or an argument this engine cannot honour (an assistant model, guidance).
        TypeError: an argument that is neither a generate argument, a generation-config field nor an input of the
            target's forward.
    """
    from specheads import SpeculativeLM, load_heads

    given = {name: value for name, value in arguments.items() if value is not None}
    inputs, input_ids = given.pop("inputs", None), given.pop("input_ids", None)
    if inputs is not None and input_ids is not None:
        raise ValueError("pass the prompt as `inputs` or as `input_ids`, not both")
    prompt = inputs if inputs is not None else input_ids
    if not isinstance(prompt, torch.Tensor):
        raise ValueError(f"specheads' custom_generate needs the prompt ids as a tensor (inputs or input_ids); got "
                         f"{type(prompt).__name__}")
    for name, reason in UNSUPPORTED.items():
        if name in given:
            raise ValueError(f"generate(..., {name}=...) is not supported with specheads heads: {reason}")
    if given.pop("synced_gpus", False):
        raise ValueError("generate(..., synced_gpus=True) is not supported with specheads heads: decoding runs in one "
                         "process, not in lockstep across ranks (DeepSpeed ZeRO-3 / FSDP)")
    for name in IGNORED:
        given.pop(name, None)
    lm = SpeculativeLM(model, load_heads(heads, target=model), tokenizer=given.get("tokenizer"))
    out = lm.generate(prompt, **given)
    if stats is not None:
        stats.update(lm.last_stats)
    return out
