"""Publishing a heads checkpoint folder on the Hugging Face Hub: `specheads push`, and training's `push_to_hub`.

`DraftHeads.push_to_hub` uploads loaded heads; this uploads a FOLDER as training wrote it, so what the folder holds
besides the weights travels too: Medusa-2's `target_adapter/` and the model card as it is (metrics, hand-written
notes). The uploaded card names the repository in its usage example, and the repository gets transformers'
`custom_generate` entry (inference/custom_generate.py), so `model.generate(..., custom_generate=repo_id,
trust_remote_code=True)` works.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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

    from specheads.inference.custom_generate import export_for_transformers

    api = HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        staged = export_for_transformers(folder, Path(tmp) / "heads", repo_id=repo_id)  # checks the folder first
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            commit = api.upload_folder(repo_id=repo_id, folder_path=str(staged), commit_message=commit_message)
        except Exception as err:  # no network, no token, no write access: many error types, one message
            raise OSError(f"pushing {folder} to the Hub repository {repo_id!r} failed: {err}") from err
    return str(getattr(commit, "commit_url", commit))
