"""TensorBoard event files: the run's own writer against tensorboardX's, record for record."""
import glob
import struct

from jax3d.train import events
from jax3d.train.metrics import MetricsWriter


def _records(path):
    """(length bytes, its masked CRC, data, its masked CRC) for each TFRecord in the file."""
    data, out, i = open(path, "rb").read(), [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        (length_crc,) = struct.unpack_from("<I", data, i + 8)
        (data_crc,) = struct.unpack_from("<I", data, i + 12 + n)
        out.append((data[i:i + 8], length_crc, data[i + 12:i + 12 + n], data_crc))
        i += 16 + n
    return out


def _decoded(log_dir):
    from tensorboardX.proto import event_pb2

    [path] = glob.glob(f"{log_dir}/events.out.tfevents.*")
    records = _records(path)
    evs = [event_pb2.Event.FromString(r[2]) for r in records]
    scalars = sorted((e.step, v.tag, v.simple_value) for e in evs[1:] for v in e.summary.value)
    return evs[0].file_version, scalars, records


def test_crc32c_gives_the_published_check_value():
    assert events.crc32c(b"123456789") == 0xE3069283


def test_negative_steps_and_out_of_range_values_decode():
    """A negative step, NaN, and values past float32's range (saturated to inf, as a float32 cast does)."""
    import math

    from tensorboardX.proto import event_pb2

    e = event_pb2.Event.FromString(events.event(2.5, -5, scalars={"nan": math.nan, "big": 1e39, "neg": -2**200,
                                                                   "one": True}))
    values = {v.tag: v.simple_value for v in e.summary.value}
    assert e.step == -5 and e.wall_time == 2.5
    assert math.isnan(values["nan"]) and values["big"] == math.inf and values["neg"] == -math.inf
    assert values["one"] == 1.0


def test_metrics_writer_events_decode_as_tensorboardx_writes_them(tmp_path):
    from tensorboardX import SummaryWriter

    rows = [{"step": 1, "loss": 8.3454, "lr": 6e-4, "tokens_per_s": 7142},
            {"step": 2, "loss": 8.2497, "lr": 5.97e-4, "tokens_per_s": 8559.5, "mfu": None}]
    ours = MetricsWriter(str(tmp_path / "ours"))
    reference = SummaryWriter(str(tmp_path / "reference"))
    for row in rows:
        ours.write(row)
        for k, v in row.items():
            if k != "step" and v is not None:
                reference.add_scalar(f"train/{k}", v, row["step"])
    ours.close()
    reference.close()

    version, scalars, records = _decoded(tmp_path / "ours")
    ref_version, ref_scalars, ref_records = _decoded(tmp_path / "reference")
    assert version == ref_version == "brain.Event:2"
    assert scalars == ref_scalars and len(scalars) == 6
    for length, length_crc, data, data_crc in records + ref_records:  # tensorboardX's CRCs check ours
        assert events.masked_crc32c(length) == length_crc and events.masked_crc32c(data) == data_crc


def test_two_writers_in_one_directory_write_two_files(tmp_path):
    first, second = events.EventFile(str(tmp_path)), events.EventFile(str(tmp_path))
    first.close()
    second.close()
    assert len(glob.glob(f"{tmp_path}/events.out.tfevents.*")) == 2


def test_a_fresh_run_sets_an_earlier_runs_metrics_aside(tmp_path):
    """A run from step 0 in a log dir an earlier run used keeps that run's metrics.jsonl and event files,
    moved under earlier/<time>/ (it truncated the JSON lines and mixed the event files); a resumed run
    appends to its own."""
    import json
    import os

    def run(fresh, steps):
        w = MetricsWriter(str(tmp_path), fresh=fresh)
        for s in steps:
            w.write({"step": s, "loss": float(s)})
        w.close()

    def steps_in(path):
        with open(path) as f:
            return [json.loads(line)["step"] for line in f]

    run(True, [1, 2])
    run(False, [3])  # resumed
    first_events = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "events.out.tfevents.*")))
    run(True, [1])
    assert steps_in(tmp_path / "metrics.jsonl") == [1]
    (earlier,) = glob.glob(str(tmp_path / "earlier" / "*"))
    assert steps_in(os.path.join(earlier, "metrics.jsonl")) == [1, 2, 3]
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(earlier, "events.out.tfevents.*"))) == first_events
    assert len(glob.glob(str(tmp_path / "events.out.tfevents.*"))) == 1
