"""specheads.inference: token trees, verification, acceptance, KV cache, generate, benchmark."""

if __name__ != "specheads.inference":
    raise ImportError(
        f"this folder is the package 'specheads.inference' and cannot be imported as {__name__!r}; "
        "install specheads (pip install -e .) and use `import specheads.inference`"
    )
