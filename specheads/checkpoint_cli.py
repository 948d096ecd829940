"""The command line's checkpoint commands: `export`, `import`, `info` and `push` (specheads/cli.py dispatches here)."""

from __future__ import annotations

import argparse
import json

CHECKPOINT_COMMANDS = ("export", "import", "info", "push")


def add_checkpoint_commands(sub: argparse._SubParsersAction) -> None:
    """Add the `export`, `import`, `info` and `push` subcommands to the `specheads` parser's `sub`."""
    from specheads.heads.interop import FORMATS

    export = sub.add_parser("export", help="write heads in another project's format (vLLM speculators, EAGLE, Medusa), "
                                           "for plain transformers' generate(custom_generate=...), or fine-tuned MTP "
                                           "heads into their target's model folder")
    export.add_argument("--heads", required=True, help="specheads checkpoint folder or Hub id")
    export.add_argument("--format", required=True, choices=(*FORMATS, "transformers", "mtp"),
                        help="transformers: the checkpoint plus custom_generate/, for generate(custom_generate=...); "
                        "mtp: a copy of the target's model folder whose MTP layer is these (head.type=mtp) heads, for "
                        "vLLM, SGLang and transformers' use_mtp (only the MTP layer's shard rewritten, the rest linked)")
    export.add_argument("--out", required=True, help="output folder")
    export.add_argument("--repo-id", default=None,
                        help="--format transformers: the Hub id the folder will be uploaded to (default: the folder "
                             "itself, for local use)")
    export.add_argument("--target", default=None, help="--format mtp: the target's model folder (default: the one the "
                        "heads were built for)")

    imp = sub.add_parser("import", help="convert EAGLE / Medusa / speculators heads into a specheads checkpoint")
    imp.add_argument("src", help="folder of the foreign checkpoint")
    imp.add_argument("--format", choices=FORMATS, default=None, help="default: detected from the folder")
    imp.add_argument("--target", default=None, help="target path/alias (default: the one the folder records)")
    imp.add_argument("--out", required=True, help="output folder (a specheads checkpoint)")
    imp.add_argument("--allow-pickle", action="store_true", help="read .bin/.pt weights (torch.load weights_only=True)")

    info = sub.add_parser("info", help="describe a heads checkpoint or a draft model folder (JSON); with --target, "
                                       "whether it fits that target")
    info.add_argument("heads", help="a specheads checkpoint folder or Hub id, or a draft model's")
    info.add_argument("--target", default=None, help="also check the heads against this target (exit 1 if they do not fit)")

    push = sub.add_parser("push", help="upload a heads folder to the Hugging Face Hub (card and custom_generate "
                                       "naming the repository; a Medusa-2 adapter included)")
    push.add_argument("folder", help="a specheads checkpoint folder, e.g. runs/x/best")
    push.add_argument("--repo-id", required=True, help="the Hub repository, e.g. my-org/my-heads")
    push.add_argument("--private", action="store_true", help="create the repository private")


def run_checkpoint_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run `args.command` (one of `CHECKPOINT_COMMANDS`); returns the exit status."""
    if args.command == "export":
        return run_export(args, parser)
    if args.command == "import":
        from specheads.heads.interop import import_heads

        heads = import_heads(args.src, format=args.format, target=args.target, out_dir=args.out, allow_pickle=args.allow_pickle)
        print(f"[specheads] imported {heads.config.head_type} heads into {args.out}")
        return 0
    if args.command == "info":
        from specheads.heads.describe import check_on_target, describe_heads

        summary = describe_heads(args.heads)
        if args.target is not None:
            summary["check"] = check_on_target(summary, args.target)
        print(json.dumps(summary, indent=2))
        return 1 if args.target is not None and not summary["check"]["compatible"] else 0
    from specheads.heads.hub import push_heads_folder

    print(f"[specheads] pushed {args.folder} to {args.repo_id}: "
          f"{push_heads_folder(args.folder, args.repo_id, private=args.private)}")
    return 0


def run_export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`specheads export`: another project's format, transformers' custom_generate, or MTP heads into their target."""
    if args.repo_id is not None and args.format != "transformers":
        parser.error("--repo-id goes with --format transformers")
    if args.target is not None and args.format != "mtp":
        parser.error("--target goes with --format mtp")
    if args.format == "transformers":
        from specheads.inference.custom_generate import export_for_transformers

        out = export_for_transformers(args.heads, args.out, repo_id=args.repo_id)
        print(f"[specheads] wrote {out}: model.generate(..., custom_generate={args.repo_id or str(out)!r}, "
              "trust_remote_code=True)")
        return 0
    if args.format == "mtp":
        from specheads.heads.mtp_export import export_mtp_into_target

        out = export_mtp_into_target(args.heads, args.out, target=args.target)
        print(f"[specheads] wrote {out}: the target's model folder with these MTP heads as its MTP layer "
              f"(vLLM: --speculative-config '{{\"method\": \"mtp\"}}'; specheads: --target {out} --mtp)")
        return 0
    from specheads.heads.interop import export_heads

    print(f"[specheads] wrote {export_heads(args.heads, args.format, args.out)}")
    return 0
