"""The low layer: shared record types, region maths and the toy world, importable by every package above it.

Nothing here imports the project's other packages (synth, datamodules, lightning_modules, callbacks, cli);
docs/layout.md.
"""
