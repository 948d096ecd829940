"""Publishing a heads checkpoint folder on the Hugging Face Hub: `specheads push`, and training's `push_to_hub`.

`DraftHeads.push_to_hub` uploads loaded heads; this uploads a FOLDER as training wrote it, so what the folder holds
besides the weights travels too: Medusa-2's `target_adapter/` and the model card as it is (metrics, hand-written
notes). The uploaded card names the repository in its usage example, and the repository gets transformers'
`custom_generate` entry (inference/custom_generate.py), so `model.generate(..., custom_generate=repo_id,
trust_remote_code=True)` works.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from specheads.heads.base import LOCAL_HEADS_PLACEHOLDER, custom_generate_usage, write_model_card
from specheads.heads.config import HeadsConfig


def push_heads_folder(
    folder: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str = "Upload specheads draft heads",
) -> str:
    """Upload a specheads checkpoint folder to the Hub repository `repo_id` (created if needed).

    The folder is checked first (it must load as heads); it is uploaded from a staging copy whose model card and
    `custom_generate/` name `repo_id`, so the folder itself is left as it was.

    Returns:
        The URL of the commit.

    Raises:
        FileNotFoundError / ValueError: the folder is not a loadable specheads checkpoint.
        OSError: the Hub refused or could not be reached (the message names the repository and the cause).
    """
    from huggingface_hub import HfApi

    from specheads.heads.loading import load_heads
    from specheads.inference.custom_generate import CUSTOM_GENERATE_DIR, write_custom_generate

    folder = Path(folder)
    load_heads(folder)  # complete and valid before anything is uploaded
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "heads"
        shutil.copytree(folder, staged, ignore=shutil.ignore_patterns(CUSTOM_GENERATE_DIR, ".*"))
        card = staged / "README.md"
        if card.is_file():  # kept as written (a hand-edited card too): only told where the heads now live
            text = card.read_text().replace(f'heads="{LOCAL_HEADS_PLACEHOLDER}"', f'heads="{repo_id}"')
            card.write_text(text if "custom_generate=" in text else text + custom_generate_usage(repo_id))
        else:
            write_model_card(staged, HeadsConfig.from_pretrained(folder), {}, repo_id=repo_id)
        write_custom_generate(staged, heads_location=repo_id)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            commit = api.upload_folder(repo_id=repo_id, folder_path=str(staged), commit_message=commit_message)
        except Exception as err:  # no network, no token, no write access: many error types, one message
            raise OSError(f"pushing {folder} to the Hub repository {repo_id!r} failed: {err}") from err
    return str(getattr(commit, "commit_url", commit))
