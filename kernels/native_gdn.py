"""Kernel `native_gdn`: the gated delta rule of each linear-attention layer as one native op.

The export writes a GatedDeltaNet layer's recurrence as a `Loop` over the chunk's tokens (per
token: decay the state by exp(g), read k . S, write the beta-scaled delta back as an outer
product, read q . S) that the CPU plugin fuses into its `GatedDeltaNet` node. On dev-bench-256 a
decode step spends 1.7 ms in that node for one layer's 32 x 128 x 128 state (2 MB), and a
1024-token prefill 0.34 s (docs/perf-log.md). `GatedDeltaRule` (kernels/native/gated_delta.hpp)
runs the same recurrence with each head's state in cache for the whole chunk, two passes over it
per token.

The rewrite recognises the loop by its body (the state merged through Exp/Multiply/ReduceSum/
Subtract/Add, the output written by ScatterUpdate), identifies q, k, v, g and beta by how the
body uses them, and replaces the loop's two outputs (per-token outputs and final state) with the
op's. Same math in f32, sums in another order. The state is read without the export's beam-index
reorder (an identity at batch 1 with beam_idx = [0], which is all iq36 feeds). CPU only.
"""

from __future__ import annotations

from typing import Any

NAME = "native_gdn"


class RewriteError(RuntimeError):
    pass


def _consumers(output: Any) -> list[Any]:
    return [t.get_node() for t in output.get_target_inputs()]


def _through(node: Any, types: tuple[str, ...]) -> Any:
    """Follow single-consumer Squeeze/Unsqueeze chains from `node`; returns the first other node."""
    while node.get_type_name() in types:
        nxt = _consumers(node.output(0))
        if len(nxt) != 1:
            return node
        node = nxt[0]
    return node


def _roles(loop: Any) -> dict[str, int] | None:
    """Loop input index of q, k, v, g, beta and the initial state, and the Loop output index of
    the per-token outputs and of the final state; None if the body is not the gated delta rule."""
    body = loop.get_function()
    types = {op.get_type_name() for op in body.get_ordered_ops()}
    if "ScatterUpdate" not in types or "Exp" not in types or "ReduceSum" not in types:
        return None
    params = list(body.get_parameters())
    sliced = {d.body_parameter_index: d for d in loop.get_input_descriptions()
              if type(d).__name__ == "SliceInputDescription"}
    merged = {d.body_parameter_index: d for d in loop.get_input_descriptions()
              if type(d).__name__ == "MergedInputDescription"}
    if len(sliced) != 5 or len(merged) != 2 or any(d.axis != 2 or d.part_size != 1 or d.stride != 1
                                                   for d in sliced.values()):
        return None
    roles: dict[str, int] = {}
    ones = []
    for index, d in sliced.items():
        p = params[index]
        rank = p.get_output_partial_shape(0).rank.get_length()
        users = _consumers(p.output(0))
        if rank == 3:
            if any(u.get_type_name() == "Exp" for u in users):
                roles["g"] = d.input_index
            else:
                ones.append(d.input_index)
            continue
        if len(users) != 1 or users[0].get_type_name() != "Squeeze":
            return None
        squeezed = _consumers(users[0].output(0))
        if len(squeezed) == 1 and squeezed[0].get_type_name() == "Subtract":
            if squeezed[0].input_value(0).get_node() is not users[0]:
                return None  # kv - v: not the rule as written
            roles["v"] = d.input_index
            continue
        target = _through(users[0], ("Squeeze", "Unsqueeze"))
        other = [target.input_value(i).get_node() for i in range(target.get_input_size())]
        if target.get_type_name() == "Multiply" and any(o.get_type_name() == "Add" for o in other):
            roles["q"] = d.input_index  # q reads the updated state
        else:
            roles["k"] = d.input_index
    if len(ones) != 1 or set(roles) != {"g", "q", "k", "v"}:
        return None
    roles["beta"] = ones[0]
    writes_out = False
    for index, d in merged.items():
        users = {u.get_type_name() for u in _consumers(params[index].output(0))}
        if "ScatterUpdate" in users:
            writes_out = True
        else:
            roles["state"] = d.input_index
    if not writes_out or "state" not in roles:
        return None
    results = list(body.get_results())
    for d in loop.get_output_descriptions():
        if type(d).__name__ != "BodyOutputDescription":
            return None
        src = results[d.body_value_index].input_value(0).get_node().get_type_name()
        if src == "ScatterUpdate":
            roles["out"] = d.output_index
        elif src == "Add":
            roles["state_out"] = d.output_index
    if "out" not in roles or "state_out" not in roles:
        return None
    return roles


def _without_beam_reorder(state: Any) -> Any:
    """The stateful export reorders each state by the `beam_idx` input (a Gather on axis 0) before
    use; iq36 runs batch 1 and always feeds beam_idx = [0] (worker.reference.stateful_feed), so
    the reorder is an identity that copies the 2 MB state every step. Read the state directly."""
    gather = state.get_node()
    if gather.get_type_name() != "Gather" or gather.input_value(0).get_node().get_type_name() != "ReadValue":
        return state
    index, axis = gather.input_value(1).get_node(), gather.input_value(2).get_node()
    if index.get_type_name() != "Parameter" or index.get_friendly_name() != "beam_idx":
        return state
    if axis.get_type_name() != "Constant" or axis.get_vector().tolist() != [0]:
        return state
    return gather.input_value(0)


def _unpack_concat(node: Any) -> None:
    """The export packs the loop's two outputs into one flat tensor (Reshape -> Concat) and cuts
    them out again (Slice -> Reshape). The plugin's fused node absorbs that; left alone, its
    generic Slice copies the whole state every step (1.4 ms of a decode step on dev-bench-256).
    Connect the final Reshapes' consumers to the op's outputs directly."""
    flats = []
    for j in range(2):
        users = _consumers(node.output(j))
        if len(users) != 1 or users[0].get_type_name() != "Reshape":
            return
        flats.append(users[0])
    concats = {id(c): c for f in flats for c in _consumers(f.output(0))}
    if len(concats) != 1:
        return
    concat = next(iter(concats.values()))
    if concat.get_type_name() != "Concat" or [concat.input_value(i).get_node() for i in range(2)] != flats:
        return
    rewires = []  # (final Reshape, the op's output it reproduces)
    for sl in _consumers(concat.output(0)):
        if sl.get_type_name() not in ("Slice", "StridedSlice"):
            return
        start = sl.input_value(1).get_node()
        first = start.get_type_name() == "Constant" and not start.get_vector().any()
        mine = node.output(0 if first else 1)
        for reshape in _consumers(sl.output(0)):
            if reshape.get_type_name() != "Reshape" or \
                    not reshape.get_output_partial_shape(0).compatible(mine.get_partial_shape()):
                return
            rewires.append((reshape, mine))
    for reshape, mine in rewires:
        for target in list(reshape.output(0).get_target_inputs()):
            target.replace_source_output(mine)

def apply(model: Any) -> Any:
    """Rewrite `model` (before compile) in place; returns it. Raises RewriteError if the model
    has no gated-delta-rule loop."""
    from kernels import native

    native.require_cpu(NAME, RewriteError)
    done = 0
    for loop in [op for op in model.get_ordered_ops() if op.get_type_name() == "Loop"]:
        roles = _roles(loop)
        if roles is None:
            continue
        args = [loop.input_value(roles[r]) for r in ("q", "k", "v", "g", "beta", "state")]
        args[5] = _without_beam_reorder(args[5])
        node = native.factory().create("GatedDeltaRule", args)
        node.set_friendly_name(f"{loop.get_friendly_name()}/{NAME}")
        for mine, theirs in ((0, roles["out"]), (1, roles["state_out"])):
            for target in list(loop.output(theirs).get_target_inputs()):
                target.replace_source_output(node.output(mine))
        _unpack_concat(node)
        done += 1
    if not done:
        raise RewriteError("no gated-delta-rule Loop in the model")
    model.validate_nodes_and_infer_types()
    return model
