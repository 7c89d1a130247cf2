# An editor checkpoint: not part of the package (dot-folders are skipped when embedding and
# when hot reload reads the folder again). Importing it would fail:
raise RuntimeError("a checkpoint was embedded")
