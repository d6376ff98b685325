"""Collective-permutes the compiled pipeline executes per step, per schedule, read from the compiled HLO.

Compiles the toy pipeline (tests/pipeline_toy.py, its layer stack stored in pipeline order as the train state
keeps it) or a small GPT's train step on emulated CPU devices and counts `collective-permute`
instructions where they sit: outside the tick loop (run once), in the loop body (run every tick), or in
a conditional inside the body (run on the ticks the schedule table says something is sent in that
direction). Direction comes from each instruction's source-target pairs. Other collectives outside the
loop are listed too: a reorder of the stage-sharded layer stack would show there (as all-gathers on the CPU).

    python -m benchmarks.pipeline_comm --stages 4 --microbatches 8 [--model gpt [--pipeline-layout 3,2,2,1]]
"""
from __future__ import annotations

import json
import re

from jax3d.cli.common import OneLineParser, layer_counts
from jax3d.parallel.mesh import emulate_cpu_devices


def _computations(text):
    """{name: body text} of an HLO module's computations."""
    out, name, lines = {}, None, []
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            name, lines = m.group(1), []
        elif line.startswith("}") and name:
            out[name] = "\n".join(lines)
            name = None
        elif name:
            lines.append(line)
    return out


def count_permutes(text, ticks, sends_fwd, sends_bwd):
    """(static count, executed count per step, outside-the-loop count) of collective-permutes, and
    {kind: count} of other collectives outside the loop."""
    comps = _computations(text)
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    branches = set()
    for body in bodies:
        for m in re.finditer(r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)|"
                             r"false_computation=%?([\w.\-]+))", comps.get(body, "")):
            for group in m.groups():
                if group:
                    branches.update(n.strip().lstrip("%") for n in group.split(","))
    static = executed = outside = 0
    others = {}  # other collectives outside the loop (a parameter reorder shows up here)
    for name, body in comps.items():
        for line in body.splitlines():
            kind = re.search(r"\b(all-to-all|all-gather|all-reduce|reduce-scatter)(-start)?\(", line)
            if kind and name not in bodies and name not in branches:
                others[kind.group(1)] = others.get(kind.group(1), 0) + 1
            if not re.search(r"collective-permute(-start)?\(", line):
                continue
            static += 1
            forward = bool(re.search(r"source_target_pairs=\{\{0,1\}", line))
            if name in bodies:
                executed += ticks
            elif name in branches:
                executed += sends_fwd if forward else sends_bwd
            else:
                executed += 1
                outside += 1
    return static, executed, outside, others


def _gpt_step_hlo(stages, m, schedule, virtual, counts=()):
    """Compiled HLO of a small GPT's train step on (1, stages, 1), from abstract shapes; `counts`:
    layers per virtual stage of an uneven split (empty: 2 layers a stage)."""
    import jax

    from jax3d.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from jax3d.parallel.plan import resolve
    from jax3d.train.step import abstract_batch, build_steps
    cfg = Config(model=ModelConfig(num_layers=sum(counts) or 2 * stages, hidden_size=64, num_attention_heads=4,
                                   seq_length=16, vocab_size=256, hidden_dropout=0.0, attention_dropout=0.0),
                 parallel=ParallelConfig(pipeline_parallel=stages, pipeline_schedule=schedule,
                                         virtual_stages=virtual, pipeline_layout=tuple(counts)),
                 train=TrainConfig(micro_batch_size=2, global_batch_size=2 * m))
    plan = resolve(cfg, stages)
    steps = build_steps(plan, plan.mesh.build())
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         steps.abstract_state, steps.state_shardings)
    batch = abstract_batch(steps, steps.model.sample_shapes())
    return steps.train_step.lower(state, batch).compile().as_text()


def main():
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zb-h1"])
    p.add_argument("--model", choices=["toy", "gpt"], default="toy",
                   help="the toy pipeline alone, or a small GPT's whole train step (optimizer included)")
    p.add_argument("--pipeline-layout", default="",
                   help="gpt only: layers per virtual stage, comma-separated (an uneven split); schedules whose "
                        "stages x virtual stages differ from its length are skipped")
    a = p.parse_args()
    try:
        counts = layer_counts(a.pipeline_layout, "--pipeline-layout")
    except ValueError as e:
        p.error(str(e))
    if counts and a.model != "gpt":
        p.error("--pipeline-layout needs --model gpt")
    emulate_cpu_devices(a.stages)
    import jax

    from jax3d.pipeline import make_layout, make_schedule, program, to_pipeline_order
    from tests import pipeline_toy as toy  # the pipeline tests' model (run from the checkout's root)
    mesh = jax.make_mesh((1, a.stages, 1), ("data", "stage", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    for name in a.schedules:
        v = 2 if name == "interleaved" else 1
        if counts and len(counts) != a.stages * v:
            continue
        sched = make_schedule(name, a.stages, a.microbatches, v)
        if a.model == "gpt":
            text = _gpt_step_hlo(a.stages, a.microbatches, name, v, counts)
        else:
            layout = make_layout(2 * a.stages, a.stages, v)
            st, sh = jax.eval_shape(lambda: toy.init(jax.random.key(0), layers=2 * a.stages))
            st = jax.eval_shape(lambda s: to_pipeline_order(s, layout), st)
            mbs = jax.eval_shape(lambda: toy.microbatches(jax.random.key(0), m=a.microbatches, batch=4, seq=8))
            with jax.set_mesh(mesh):
                text = toy.pipelined(mesh, sched, params_in_pipeline_order=True).lower(
                    st, sh, mbs, None).compile().as_text()
        prog = program.lower(sched)
        sends = getattr(prog, "sends", None)
        fwd = int(sends[:, 0].sum()) if sends is not None else sched.ticks
        bwd = int(sends[:, 1].sum()) if sends is not None else sched.ticks
        static, executed, outside, others = count_permutes(text, sched.ticks, fwd, bwd)
        print(json.dumps({"model": a.model, "schedule": name, **({"pipeline_layout": counts} if counts else {}), "stages": a.stages, "microbatches": a.microbatches, "ticks": sched.ticks,
                          "static_permutes": static, "outside_loop": outside, "executed_per_step": executed,
                          "ticks_sending_fwd": fwd, "ticks_sending_bwd": bwd,
                          "other_collectives_outside_loop": others}), flush=True)


if __name__ == "__main__":
    main()
