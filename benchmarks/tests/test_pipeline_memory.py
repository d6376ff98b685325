"""benchmarks/pipeline_memory.py on the session's 8 CPU devices."""


def test_memory_benchmark_sweeps_zero_stages_under_pipelining(capsys):
    """benchmarks/pipeline_memory.py, compiled on the session's 8 CPU devices as (4, 2, 1): one line per ZeRO
    stage, in which ZeRO-3 shards the parameters and gradients over the 4 data ranks and ZeRO-1 neither."""
    import json

    from benchmarks import pipeline_memory

    assert pipeline_memory.main(["--mesh", "4", "2", "1", "--num-layers", "2", "--hidden-size", "64",
                                 "--seq-length", "32", "--microbatches", "2", "--schedules", "1f1b",
                                 "--zero", "1", "3"]) == 0
    one, three = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert (one["zero"], three["zero"]) == (1, 3) and one["microbatches"] == three["microbatches"] == 2
    assert three["params_mib"] < one["params_mib"] and three["grads_mib"] < one["grads_mib"]
    assert three["opt_state_mib"] == one["opt_state_mib"] and one["ticks"] == 6
