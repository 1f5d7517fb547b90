"""``python -m app.exporters.mar_script FOLDER MODEL_FILE WEIGHTS OUT SIZE``: script an eager
TorchServe archive's model, in a process of its own (``--trust-archive-code`` only).

As TorchServe's base handler does: import ``MODEL_FILE`` from the unpacked archive, take the
one ``nn.Module`` class it defines, build it without arguments and load the state dict
``WEIGHTS`` into it (with ``weights_only=True``: tensors only, no pickled objects). Then
``torch.jit.script`` it (``torch.jit.trace`` on [2, 3, SIZE, SIZE] if scripting fails) and
save it to ``OUT``. Exits 1 with one line on stderr when any of that fails.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import torch
from torch import nn


def main(argv: list[str]) -> int:
    folder, model_file, weights, out, size = argv
    path = Path(folder) / Path(model_file).name
    sys.path.append(folder)  # the model file's own imports; never ahead of this project's
    spec = importlib.util.spec_from_file_location("archive_model", path)
    if spec is None or spec.loader is None:
        print(f"cannot import {model_file}", file=sys.stderr)
        return 1
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    classes = [
        value
        for value in vars(module).values()
        if inspect.isclass(value)
        and issubclass(value, nn.Module)
        and value.__module__ == module.__name__
    ]
    if len(classes) != 1:
        print(
            f"{model_file} defines {len(classes)} nn.Module classes, not exactly one",
            file=sys.stderr,
        )
        return 1
    model = classes[0]()
    state = torch.load(weights, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    model.eval()
    try:
        scripted = torch.jit.script(model)
    except Exception:
        example = torch.rand(2, 3, int(size), int(size))
        scripted = torch.jit.trace(model, example)  # type: ignore[no-untyped-call]
    torch.jit.save(scripted, out)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as exc:
        print(f"{type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
        sys.exit(1)
