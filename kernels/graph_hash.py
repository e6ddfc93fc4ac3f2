"""The specialised graph's identity: a hash of the rewritten model's structure.

The candidate compiles the locked IR after the profile's rewrites (`kernels/`). The locked IR
is identified by the manifest's fingerprint; this hash identifies what the rewrites made of it,
so that a change to a kernel's code that changes the graph changes the identity reported at
start (the worker's READY), in `/v1/models` and in gate reports, even when the profile did not
change.

What is hashed, for every node in topological order (Loop/If bodies recursively): its type and
opset, its attributes, its inputs (as producer index and port), its outputs' element types and
partial shapes, and for constants their type, shape and, up to 4 KiB, their bytes. Larger
constants are the IR's weights (covered by the model fingerprint) or views of them: their
friendly name stands in. No serialisation: ~0.25 s per thousand nodes (dev-tiny: 1,700).
"""

from __future__ import annotations

import hashlib
from typing import Any

SMALL_CONSTANT = 4096  # bytes of a constant hashed by value; larger ones by name


def _attributes(node: Any) -> str:
    try:
        attrs = node.get_attributes()
    except Exception:  # some ops (e.g. with bodies) have attributes the binding cannot convert
        return "?"
    return repr(sorted((k, repr(v)) for k, v in attrs.items()))


def _update(h: Any, model: Any) -> None:
    index: dict[str, int] = {}
    for i, node in enumerate(model.get_ordered_ops()):
        index[node.get_name()] = i
        kind = node.get_type_info()
        inputs = [(index.get(v.get_node().get_name(), -1), v.get_index()) for v in node.input_values()]
        outputs = [(str(node.get_output_element_type(k)), str(node.get_output_partial_shape(k)))
                   for k in range(node.get_output_size())]
        h.update(f"{i}|{kind.name}|{kind.version_id}|{inputs}|{outputs}|{_attributes(node)}\n".encode())
        if kind.name == "Constant":
            data = node.get_data()
            if data.nbytes <= SMALL_CONSTANT:
                h.update(data.tobytes())
            else:
                h.update(node.get_friendly_name().encode())
        if kind.name == "Parameter":
            h.update(",".join(sorted(node.output(0).get_names())).encode())
        get_function = getattr(node, "get_function", None)  # Loop / TensorIterator bodies
        if callable(get_function):
            try:
                body = get_function()
            except Exception:
                body = None
            if body is not None:
                _update(h, body)


def structure_hash(model: Any, *more: Any) -> str:
    """16 hex digits identifying `model`'s structure (see the module docstring); with `more`
    models (the candidate's decode graph), of all of them in order."""
    h = hashlib.sha256()
    for i, m in enumerate((model, *more)):
        if i:
            h.update(f"model {i}\n".encode())
        _update(h, m)
        for out in m.outputs:
            h.update(("out:" + ",".join(sorted(out.get_names()))).encode())
    return h.hexdigest()[:16]
