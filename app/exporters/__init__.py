"""Building models and writing them into a model store; ``python -m app.export`` is the
command line over this package.

- ``base``: ``ExportError``, ``BuildRequest`` (what the command line asked for), ``SplitModel``
  and the check that a model split at its head still computes its logits
- ``store``: ``export_split`` and ``export_module``: trace, verify and write a store
- ``checkpoints``: reading state dicts and training checkpoints
- ``timm_models`` / ``torchvision_models``: building one library's model and splitting it
- ``registry``: which library a name belongs to, and close matches for a name that is in none

Only ``registry`` imports timm or torchvision, and only when a model is built or listed.
"""
