"""The training loop and its composition root: the Trainer's parts and the code that builds model,
optimizer, DeepSpeed engine, data, plugins and writers from the configuration.

The top layer: may import every other megapost package; nothing in megapost imports it (except the
``megapost.pretrain`` entry point).
"""
