"""The content digest of a TorchScript module: what it computes, as bytes that do not depend
on when, where or how often it was exported. Its weights and buffers (by name, dtype and
shape), its graph with the source locations, the mangled class names and the value names
taken out, and the tensors the trace captured as constants. Two exports of the same weights
give the same digest; any other weights, or another graph (a scaled output, another
activation), give another.

The export records each module's digest in the manifest (``Manifest.content``), whose
identity (the served id, ``X-Model-Id``) is built from them; a worker computes it again on
the module it loads, before anything rewrites it, and refuses a module that is not what the
manifest says.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from typing import Any

import torch

_COMMENT = re.compile(r"\s*#.*$", re.M)
_MANGLE = re.compile(r"___torch_mangle_\d+\.")
_VALUE = re.compile(r"%[\w.]+")


def _frame(digest: Any, tag: bytes, payload: bytes | memoryview) -> None:
    """Length-prefixed: no two different sequences of fields hash the same bytes."""
    digest.update(struct.pack("<I", len(tag)) + tag + struct.pack("<Q", len(payload)))
    digest.update(payload)


def _tensor(digest: Any, tag: bytes, name: str, tensor: torch.Tensor) -> None:
    tensor = tensor.detach().cpu().contiguous()
    meta = [name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
    _frame(digest, tag, json.dumps(meta).encode())
    _frame(digest, b"data", tensor.view(-1).view(torch.uint8).numpy().tobytes())


def graph_text(module: torch.jit.ScriptModule) -> str:
    """The module's inlined graph, without source comments, mangled class names or the
    trace's value names (renumbered in order of appearance)."""
    text = _MANGLE.sub("", _COMMENT.sub("", str(module.inlined_graph)))
    names: dict[str, str] = {}
    return _VALUE.sub(lambda m: names.setdefault(m.group(0), f"%{len(names)}"), text)


def module_digest(module: torch.jit.ScriptModule) -> str:
    """The hex sha256 of what ``module`` computes (see the module's docstring): take it on
    the module as ``torch.jit.load`` gives it, before freezing or a dtype change."""
    digest = hashlib.sha256()
    state = module.state_dict()
    for name in sorted(state):
        _tensor(digest, b"tensor", name, state[name])
    _frame(digest, b"graph", graph_text(module).encode())
    for node in module.inlined_graph.nodes():
        constant = node.kind() == "prim::Constant" and node.hasAttribute("value")
        if constant and node.kindOf("value") == "t":  # a tensor the trace captured
            _tensor(digest, b"constant", "", node.t("value"))
    return digest.hexdigest()
