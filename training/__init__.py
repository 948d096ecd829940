"""specheads.training"""

if __name__ != "specheads.training":
    raise ImportError(
        f"this folder is the package 'specheads.training' and cannot be imported as {__name__!r}; "
        "install specheads (pip install -e .) and use `import specheads.training`"
    )
