"""Checkpoints against a hostile bucket, in-process: the project's `S3Checkpoints`, `TieredState` over
the shipped fakes and the CLI, against moto's server with the drills' fault proxy in front of it where S3 itself
must misbehave (denied reads, 500s after a committed PUT, DeleteObjects refusing keys inside a 200).

A step counts only when its bytes are there and are this run's: every reader falls back past a step whose piece
is missing, pruning never deletes a readable step for an unreadable one nor under a reader, deletes say what they
left, identities keep runs apart, copies and renames behave, content is checked, and the CLI answers in one line.
"""

import hashlib
import json
import logging
import os
import time

import boto3
import pytest
import torch
from typer.testing import CliRunner

from orchestrator.cli.main import app
from orchestrator.drills.s3_proxy import S3FaultProxy
from orchestrator.errors import CheckpointError, ConfigError, Refusal
from orchestrator.state.calls import LocalCalls
from orchestrator.state.fakes import LocalGroup, model_units, values
from orchestrator.state.s3_store import Identity, S3Checkpoints
from orchestrator.state.tiers import TieredState
from planner import Pipeline, Plan, Stage
from tests.moto_s3 import CREDS, TEST_ENV, moto_s3, use_test_credentials

pytestmark = pytest.mark.unit
runner = CliRunner()
LAYERS = 4
MODEL = {"name": "m", "num_layers": 2, "hidden_size": 8, "num_heads": 2, "vocab_size": 16, "seq_len": 4}


@pytest.fixture(scope="module")
def s3():
    """(moto's endpoint, a fault proxy in front of it)."""
    use_test_credentials()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with moto_s3("hostile") as url:
        proxy = S3FaultProxy(url)
        yield url, proxy
        proxy.stop()


@pytest.fixture
def proxy(s3):
    s3[1].clear()
    yield s3[1]
    s3[1].clear()


def store_at(url: str, prefix: str, **kw) -> S3Checkpoints:
    return S3Checkpoints(f"s3://hostile/{prefix}", client=boto3.client("s3", endpoint_url=url, **CREDS), **kw)


def state(seed: float, rows: int = 8):
    g = torch.Generator().manual_seed(int(seed))
    return {"wte.weight": {"param": torch.randn(rows, 16, generator=g), "exp_avg": torch.randn(rows, 16, generator=g),
                           "exp_avg_sq": torch.rand(rows, 16, generator=g)},
            "ln_f.bias": {"param": torch.full((4,), seed), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.ones(4)}}


def meta(job: str = "tiny", run: str = "run-a") -> dict:
    return {"job": job, "run_id": run}


def model_state(seed: float):
    """A small real model's units (what `export` writes as a Hugging Face directory), and its manifest meta."""
    from planner.specs import ModelSpec
    from workers.model import all_params

    model = ModelSpec(**MODEL)
    st = {p.name: {k: torch.full(tuple(p.shape), seed + i) for i, k in enumerate(("param", "exp_avg", "exp_avg_sq"))}
          for p in all_params(model)}
    return st, meta() | {"model": model.model_dump()}


def identity(job: str = "tiny", run: str = "run-a", st=None) -> Identity:
    st = st or state(0)
    return Identity.of(meta(job, run), {n: list(t["param"].shape) for n, t in st.items()})


def drop_piece(store: S3Checkpoints, step: int, unit: str = "wte.weight") -> str:
    """What a lifecycle rule or an operator's `aws s3 rm` does to one piece."""
    key = store.manifest(step)["units"][unit]["pieces"][0]["key"]
    store.client.delete_object(Bucket=store.bucket, Key=key)
    return key


def _one_line(res) -> str:
    assert "Traceback" not in res.output and 'File "' not in res.output, res.output
    text = " ".join(res.output.split())
    assert text
    return text


# -- acceptance 1: a missing piece refuses its step, everywhere ----------------------------------------------------
def test_a_missing_piece_refuses_its_step_in_every_reader(s3, tmp_path, monkeypatch, caplog):
    url, _ = s3
    for k, v in TEST_ENV.items():
        monkeypatch.setenv(k, v)
    store = store_at(url, "missing")
    for s in (1, 2, 3):
        store.save(s, *model_state(s)[:1], float(s), model_state(s)[1])
    key = drop_piece(store, 3, "wte.weight")
    with caplog.at_level(logging.WARNING, logger="hetspot.checkpoints"):
        step, got, opt, _ = store.load_latest()
    assert step == 2 and opt == 2.0
    assert torch.equal(got["wte.weight"]["param"], model_state(2)[0]["wte.weight"]["param"])
    assert any("refusing checkpoint step 3" in m and key in m for m in caplog.messages), caplog.messages
    with pytest.raises(CheckpointError, match="not in the bucket") as e:
        store.load(3)
    assert e.value.refusal is Refusal.MISSING and e.value.step == 3
    assert store.verify(3) and key in store.verify(3)[0] and store.verify(2) == []
    assert store.newest_whole()[0] == 2  # the resume choice reads the listing, not only the manifest

    # the CLI: verify names the step and still prints the good ones; export uses the previous good step
    base = ["--endpoint-url", url]
    res = runner.invoke(app, ["checkpoints", "verify", "s3://hostile/missing", *base])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "step 3: BAD" in res.stdout and key in res.stdout
    assert "step 2: ok" in res.stdout and "step 1: ok" in res.stdout
    res = runner.invoke(app, ["checkpoints", "export", "s3://hostile/missing", *base, "--out", str(tmp_path / "hf"),
                              "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["step"] == 2 and "step 3 refused" in res.output
    res = runner.invoke(app, ["checkpoints", "export", "s3://hostile/missing", *base, "--step", "3", "--out",
                              str(tmp_path / "hf3")])
    assert res.exit_code == 2 and "not in the bucket" in _one_line(res) and not (tmp_path / "hf3").exists()

    # --resume's choice: the job goes on from step 2, in its own run
    from orchestrator.api import check_checkpoint, lost_controller_message
    from orchestrator.job_spec import parse_job

    job = parse_job({"name": "tiny", "model": MODEL, "train": {"global_batch": 4},
                     "cluster": {"nodes": [{"name": "a", "gpu_type": "T4", "num_gpus": 1}]},
                     "checkpoint": {"uri": "s3://hostile/missing", "endpoint_url": url}}, "job.yaml")
    assert check_checkpoint(job, "job.yaml", resume=True, steps=10) == "run-a"
    assert "newest complete step 2 under" in lost_controller_message(job, "job.yaml", "gone")


def plan(*stages: tuple[int, int, str]) -> Plan:
    return Plan(model_name="m", num_layers=LAYERS, global_batch=8, pipelines=[Pipeline(
        num_samples=8, micro_batch_size=1, num_micro_batches=8, stages=[
            Stage(layer_start=a, layer_end=b, gpu_type="L4", node=n, devices=[f"{n}/0"]) for a, b, n in stages])])


OLD = plan((0, 1, "a"), (1, 2, "b"), (2, 3, "c"), (3, 4, "d"))
NEW = plan((0, 4, "a"))


def trained(url: str, prefix: str, steps: int = 4, keep: int = 3, run: str = "r1", restore_from: str = "s3",
            **store_kw):
    calls = LocalCalls(["a", "b", "c", "d"])
    s3 = S3Checkpoints(f"s3://hostile/{prefix}", url, **store_kw)
    store = TieredState(1, s3, s3_every=1, keep=keep, meta={"job": prefix, "run_id": run},
                        model_units=model_units(LAYERS), calls=calls, restore_from=restore_from)
    group = LocalGroup(OLD, calls)
    for step in range(steps):
        group.commit(step)
        store.after_step(group, step)
        store.flush()
    return calls, s3, store, group


def assert_holds(group: LocalGroup, step: int) -> None:
    for shards in group.shards:
        for unit, s in shards.items():
            for k, v in values(step, unit).items():
                assert (s[k] == v).all(), (unit, k, step)


def test_the_tier_restore_refuses_a_step_with_a_missing_piece_whether_listed_or_not(s3, proxy):
    url, _ = s3
    # listed gone: the survey (a listing matched against the manifest) refuses it before any read
    _, s3a, store, _ = trained(url, "restore-gone")
    key = s3a.manifest(3)["units"]["layer2"]["pieces"][0]["key"]
    s3a.client.delete_object(Bucket="hostile", Key=key)
    new = LocalGroup(NEW, LocalCalls(["a"]))
    store.calls = new.calls
    store.keepers.clear()
    r = store.restore(new)
    assert r.step == 2 and r.refused_steps == [3] and key in r.refused["3"]
    assert 3 in store.bad_steps  # broken: its redo may replace it
    assert_holds(new, 2)
    # gone between the listing and the read (a lifecycle rule at that moment): refused when read, the same way
    r, store = restore_with_a_read_refused(proxy, "restore-404", "layer2", "NoSuchKey")
    assert r.step == 2 and r.refused_steps == [3] and "not in the bucket" in r.refused["3"]
    assert 3 in store.bad_steps


def restore_with_a_read_refused(proxy, prefix: str, unit: str, code: str):
    """Train 4 steps to S3 through the proxy, then restore on a fresh node (S3 only) while the proxy answers
    `code` to the read of `unit`'s piece of step 3; (the restore's report, the state plane). Step 2 is restored."""
    _, s3a, store, _ = trained(proxy.url, prefix)
    key = s3a.manifest(3)["units"][unit]["pieces"][0]["key"]
    proxy.fail("GET", key=key.split("/", 1)[1], code=code)
    new = LocalGroup(NEW, LocalCalls(["a"]))
    store.calls, _ = new.calls, store.keepers.clear()
    r = store.restore(new)
    assert_holds(new, 2)
    return r, store


def test_a_read_denied_refuses_the_step_for_this_restore_but_never_marks_it_for_deletion(s3, proxy):
    r, store = restore_with_a_read_refused(proxy, "restore-denied", "layer1", "AccessDenied")
    assert r.step == 2 and "AccessDenied" in r.refused["3"]
    assert 3 not in store.bad_steps  # S3 refused a read: the step may be fine, it is never deleted for it


def test_a_workers_own_error_is_not_blamed_on_s3_and_does_not_loop(s3):
    """Defect 12: a restore source answering an error of its own (not an S3 refusal) is a re-plan, once, and no
    S3 step is refused or marked bad for it."""
    from orchestrator.errors import FailureKind, WorkerFailure
    from workers.transfer import LoadReport, Refused

    url, _ = s3
    _, _, store, _ = trained(url, "own-error")
    new = LocalGroup(NEW, LocalCalls(["a"]))
    store.calls, _ = new.calls, store.keepers.clear()
    calls = []

    def load(per_rank, step, opt, s3cfg, overlap=True):
        calls.append(step)
        return [LoadReport(refused=Refused("worker process 7 keeps step 2, not step 3"))]

    new.load = load
    with pytest.raises(WorkerFailure) as e:
        store.restore(new)
    assert e.value.kind is FailureKind.RESTORE_SOURCE and calls == [3]
    assert store.bad_steps == set()


# -- acceptance 2: expiry of the newest step's pieces never costs a readable step ---------------------------------
@pytest.mark.parametrize("keep", [1, 2])
def test_pruning_never_deletes_a_readable_step_for_an_expired_one(s3, keep):
    url, _ = s3
    store = store_at(url, f"expired-{keep}")
    for s in (1, 2, 3):
        store.save(s, state(s), float(s), meta())
    for unit in ("wte.weight", "ln_f.bias"):  # a lifecycle rule expired step 3's pieces (its manifest, written
        drop_piece(store, 3, unit)  # last, expires last)
    pruned = store.keep_newest(keep, identity())
    assert store.complete_steps() == [2, 1][:keep] and 3 in pruned.deleted
    assert store.load_latest(identity())[0] == 2
    # and the job restores: a tier restore takes the newest readable step
    _, s3t, tiers, _ = trained(url, f"expired-tiers-{keep}", keep=2)
    for u in s3t.manifest(3)["units"].values():
        for p in u["pieces"]:
            s3t.client.delete_object(Bucket="hostile", Key=p["key"])
    tiers.uploader._prune()
    assert s3t.complete_steps() == [2]  # keep 2 had pruned step 1 already
    new = LocalGroup(NEW, LocalCalls(["a"]))
    tiers.calls, _ = new.calls, tiers.keepers.clear()
    assert tiers.restore(new).step == 2
    assert_holds(new, 2)


def test_pruning_reads_back_the_step_that_stays_and_a_byte_flipped_in_place_never_costs_the_older_ones(s3):
    """One byte of a piece of step 3 flipped, its size unchanged (an older object version put back, a second
    writer): the listing showed step 3 whole by size, so pruning with keep 1 deleted steps 1 and 2 and left nothing
    loadable. Now the listing's ETag differs from the one S3 answered the piece's PUT with (the manifest records
    it), and a step that stays is read back once before an older one goes: step 3 is refused, step 2 stays."""
    url, _ = s3
    store = store_at(url, "flipped")
    for s in (1, 2, 3):
        store.save(s, state(s), float(s), meta())
    key = store.manifest(3)["units"]["wte.weight"]["pieces"][0]["key"]
    body = bytearray(store.client.get_object(Bucket="hostile", Key=key)["Body"].read())
    body[-1] ^= 0xFF
    store.client.put_object(Bucket="hostile", Key=key, Body=bytes(body))
    (st,) = [x for x in store.survey(identity()) if x.step == 3]
    assert not st.ok and "replaced since it was written" in st.reason
    pruned = store.keep_newest(1, identity())
    assert 2 not in pruned.deleted and 1 in pruned.deleted and 3 in pruned.deleted
    assert store.complete_steps() == [2]
    assert store.load_latest(identity())[0] == 2
    # a sound newest step is read back once: the next prune keeps it without reading it again
    store.save(4, state(4), 4.0, meta())
    store.keep_newest(1, identity())
    assert store.complete_steps() == [4] and 4 in store._read_back


# -- acceptance 3: a reader is not pruned under ------------------------------------------------------------------
def test_a_step_being_read_is_pruned_only_after_its_reader_is_done(s3):
    url, _ = s3
    writer = store_at(url, "leased")
    reader = store_at(url, "leased")
    for s in (1, 2, 3):
        writer.save(s, state(s), float(s), meta())
    with reader.lease(3):
        m = reader.whole_manifest(3)
        first, _ = reader.read_unit(m, "ln_f.bias")  # half-way through step 3
        for s in (4, 5):
            writer.save(s, state(s), float(s), meta())
            pruned = writer.keep_newest(1, identity())
            assert pruned.held == [3] and 3 not in pruned.deleted
        rest, _ = reader.read_unit(m, "wte.weight")  # the reader finishes
        assert torch.equal(rest["param"], state(3)["wte.weight"]["param"])
    assert writer.complete_steps() == [5, 3]
    assert writer.keep_newest(1, identity()).deleted == [3]  # released: pruned now
    assert writer.complete_steps() == [5]
    assert writer.leased_steps() == set()


def test_a_reader_whose_clock_is_20_minutes_slow_keeps_its_step(s3):
    """Leases run on the bucket's clock: a reader 20 minutes behind (more than the 15-minute TTL) still holds its
    step against a pruner whose clock is right, and one 20 minutes ahead does not hold it for longer."""
    url, _ = s3
    writer = store_at(url, "skewed")
    slow = store_at(url, "skewed", clock=lambda: time.time() - 1200)
    fast = store_at(url, "skewed", clock=lambda: time.time() + 1200, lease_ttl_s=1.0)
    for s in (1, 2, 3):
        writer.save(s, state(s), float(s), meta())
    with slow.lease(2):
        assert writer.keep_newest(1, identity()).held == [2]
        assert writer.complete_steps() == [3, 2]
    fast.lease(3).__enter__()  # a fast reader that died: its 1 s lease lapses on the bucket's clock
    time.sleep(2.1)
    assert writer.leased_steps() == set()


def test_an_expired_lease_does_not_hold_a_step(s3):
    url, _ = s3
    store = store_at(url, "lapsed", lease_ttl_s=1.0)
    for s in (1, 2):
        store.save(s, state(s), float(s), meta())
    lease = store.lease(1).__enter__()  # a reader that died: its lease is never released
    # read at the lease's own clock, not the wall's: a loaded machine may take longer than the TTL to list
    assert store.leased_steps(now=lease.taken_at + 0.999) == {1}  # held for its whole TTL, not cut to a whole second
    assert store.leased_steps(now=lease.taken_at + 2.0) == set()


# -- acceptance 4: deletes that tell the truth -------------------------------------------------------------------
@pytest.mark.parametrize("code", ["AccessDenied", "InternalError"])
def test_rm_names_the_keys_a_delete_left(s3, proxy, code, monkeypatch):
    for k, v in TEST_ENV.items():
        monkeypatch.setenv(k, v)
    store = store_at(proxy.url, f"rm-{code.lower()}")
    for s in (1, 2):
        store.save(s, state(s), float(s), meta())
    proxy.refuse_deletes(key=r"/units/wte\.weight/", code=code)
    res = runner.invoke(app, ["checkpoints", "rm", f"s3://hostile/rm-{code.lower()}", "--endpoint-url", proxy.url,
                              "--all", "--yes"])
    assert res.exit_code == 1, res.output
    assert "did not delete 2 object(s)" in res.output and code in res.output and "wte.weight" in res.output
    assert "deleted 2 step(s)" not in res.output
    proxy.clear()
    assert store.complete_steps() == []  # each manifest went first, on its own: no step is left half there
    assert [i.num_objects for i in store.steps()] == [1, 1]  # the refused pieces, reported and still listed
    assert runner.invoke(app, ["checkpoints", "rm", f"s3://hostile/rm-{code.lower()}", "--endpoint-url", proxy.url,
                               "--all", "--yes"]).exit_code == 0
    assert store.steps() == []


def test_pruning_reports_the_keys_left_and_tries_again(s3, proxy):
    store = store_at(proxy.url, "prune-left")
    for s in (1, 2):
        store.save(s, state(s), float(s), meta())
    proxy.refuse_deletes(key="/units/", code="InternalError")
    store.save(3, state(3), 3.0, meta())
    pruned = store.keep_newest(1, identity())
    assert sorted(pruned.failed) == [1, 2] and pruned.deleted == []
    assert all("InternalError" in k for keys in pruned.failed.values() for k in keys)
    proxy.clear()
    assert store.keep_newest(1, identity()).deleted == [1, 2]  # the next prune finishes the job
    assert [i.step for i in store.steps()] == [3]


def test_a_refused_steps_redo_is_written_when_deletes_fail(s3, proxy):
    """Defect 4: a refused step's manifest used to survive a failed DeleteObjects, and its redo met it (412)."""
    store = store_at(proxy.url, "redo")
    store.save(2, state(2), 2.0, meta())
    proxy.refuse_deletes(key="", code="AccessDenied")  # every key of a DeleteObjects refused
    assert store.prepare_step(2, identity(), bad=True) == "new"  # the manifest goes on its own first
    store.save(2, state(7), 2.0, meta())
    assert store.verify(2) == [] and torch.equal(store.load(2)[0]["ln_f.bias"]["param"], torch.full((4,), 7.0))
    proxy.fail("DELETE", key=r"manifest\.json$", code="AccessDenied")
    with pytest.raises(CheckpointError, match="could not be deleted"):  # a manifest that cannot go: not written
        store.prepare_step(2, identity(), bad=True)


# -- acceptance 5: identity at upload, restore and pruning -------------------------------------------------------
def test_two_runs_with_different_models_on_one_prefix_never_touch_each_others_steps(s3, tmp_path, monkeypatch):
    url, _ = s3
    a, b = store_at(url, "shared-run"), store_at(url, "shared-run")
    small, big = state(1), state(1, rows=16)  # run B's model differs in shape
    for s in (1, 2, 3):
        a.save(s, state(s), float(s), meta("tiny", "run-a"))
    with pytest.raises(CheckpointError, match="written for another model") as e:  # never overwritten
        b.prepare_step(3, identity("tiny", "run-b", big))
    assert e.value.refusal is Refusal.FOREIGN
    for s in (4, 5):
        b.save(s, state(s, rows=16), float(s), meta("tiny", "run-b"))
        assert b.keep_newest(1, identity("tiny", "run-b", big)).deleted == ([] if s == 4 else [4])
    assert a.complete_steps() == [5, 3, 2, 1]  # B neither counted nor deleted A's steps
    assert [m["step"] for m in b.manifests(identity=identity("tiny", "run-b", big))] == [5]  # never loaded A's
    assert [m["step"] for m in a.manifests(identity=identity("tiny", "run-a", small))] == [3, 2, 1]
    with pytest.raises(CheckpointError, match="written for another model"):  # A's uploader at B's step 5
        a.prepare_step(5, identity("tiny", "run-a", small))
    assert a.keep_newest(1, identity("tiny", "run-a", small)).deleted == [1, 2]
    assert a.complete_steps() == [5, 3]
    # the second run is refused at submit, with the command to go on or to use another prefix
    from orchestrator.api import check_checkpoint
    from orchestrator.job_spec import parse_job

    for k, v in TEST_ENV.items():
        monkeypatch.setenv(k, v)
    other = parse_job({"name": "tiny", "model": {"preset": "tiny"}, "train": {"global_batch": 4},
                       "cluster": {"nodes": [{"name": "a", "gpu_type": "T4", "num_gpus": 1}]},
                       "checkpoint": {"uri": "s3://hostile/shared-run", "endpoint_url": url}}, "job.yaml")
    with pytest.raises(ConfigError, match="already holds steps|another model"):
        check_checkpoint(other, "job.yaml", resume=False)


def test_two_jobs_sharing_a_prefix_never_prune_each_others_steps(s3):
    url, _ = s3
    x, y = store_at(url, "two-jobs"), store_at(url, "two-jobs")
    for s in range(1, 7):
        (x if s % 2 else y).save(s, state(s), float(s), meta("job-x" if s % 2 else "job-y", "rx" if s % 2 else "ry"))
        x.keep_newest(1, identity("job-x", "rx"))
        y.keep_newest(1, identity("job-y", "ry"))
    assert x.complete_steps() == [6, 5]  # each job's newest, neither deleted by the other
    assert x.newest_whole(identity("job-x", "rx"))[0] == 5 and y.newest_whole(identity("job-y", "ry"))[0] == 6


def test_a_resumed_run_keeps_its_lineage_and_a_new_run_id_is_another_run(s3):
    url, _ = s3
    _, s3a, first, _ = trained(url, "lineage", run="lin-1")
    again = TieredState(1, s3a, s3_every=1, keep=3, meta={"job": "lineage", "run_id": "lin-1"},
                        model_units=model_units(LAYERS), calls=LocalCalls(["a"]), restore_from="s3")
    new = LocalGroup(NEW, again.calls)
    assert again.restore(new).step == 3  # the same lineage: its steps are its own
    stranger = TieredState(1, s3a, s3_every=1, keep=3, meta={"job": "lineage", "run_id": "lin-2"},
                           model_units=model_units(LAYERS), calls=LocalCalls(["a"]), restore_from="s3")
    assert stranger.restore(LocalGroup(NEW, stranger.calls)) is None  # another run's steps are never loaded


# -- acceptance 6: a malformed manifest is refused by name; nothing else stops -----------------------------------
@pytest.mark.parametrize("damage", ["not-json", "bad-region", "old-format-unknown-model"])
def test_a_malformed_manifest_is_refused_by_name_and_uploads_and_pruning_go_on(s3, damage, caplog):
    url, _ = s3
    calls, s3a, store, group = trained(url, f"malformed-{damage}", keep=2)
    key = s3a.manifest_key(2)
    m = json.loads(s3a.client.get_object(Bucket="hostile", Key=key)["Body"].read())
    if damage == "not-json":
        body = b'{"format": "hetspot-checkpoint/4", "step": 2, "units": {'
    elif damage == "bad-region":
        m["units"]["layer1"]["pieces"][0]["region"] = [[0, "two"]]
        body = json.dumps(m).encode()
    else:  # a format-2 manifest whose model record no longer validates (a field renamed since)
        m = {"format": "hetspot-checkpoint/2", "step": 2, "optimizer_steps": 1.0, "units": m["units"],
             "meta": {"job": m["meta"]["job"], "model": {"name": "m", "layers_renamed": 4}}}
        body = json.dumps(m).encode()
    s3a.client.put_object(Bucket="hostile", Key=key, Body=body)
    (st,) = [x for x in s3a.survey() if x.step == 2]
    assert st.refusal is Refusal.MALFORMED and key in st.reason
    with caplog.at_level(logging.WARNING, logger="hetspot.checkpoints"):
        for step in (4, 5):  # uploads go on, and pruning
            group.commit(step)
            store.after_step(group, step)
            store.flush()
    assert [u.status for u in store.uploads[-2:]] == ["written", "written"]
    assert s3a.complete_steps() == [5, 4, 2]  # pruned to 2 good steps; the malformed one is not attributed: kept
    assert any("not pruning checkpoint step 2" in msg for msg in caplog.messages)
    new = LocalGroup(NEW, LocalCalls(["a"]))
    store.calls, _ = new.calls, store.keepers.clear()
    assert store.restore(new).step == 5
    assert store.upload_lag(5)["newest_step"] == 5


# -- acceptance 7: a committed manifest PUT answered 500 -----------------------------------------------------------
def test_a_manifest_put_that_commits_and_answers_500_is_recorded_written(s3, proxy):
    before = proxy.counts["faulted"]
    proxy.fail_after_commit("PUT", key=r"manifest\.json$", times=1)
    _, s3a, store, _ = trained(proxy.url, "ambiguous", steps=2)
    assert proxy.counts["faulted"] == before + 1
    assert [u.status for u in store.uploads] == ["written", "written"], store.uploads
    assert store.upload_lag(1) == {"newest_step": 1, "lag_steps": 0, "backlog": 0, "dropped": 0, "failed": 0,
                                   "no_access": []}  # what `status` prints
    assert s3a.verify(0) == [] and s3a.verify(1) == []
    # not this write: another run's manifest at that step is never taken for ours
    other = store_at(proxy.url, "ambiguous")
    with pytest.raises(CheckpointError, match="another manifest is there"):
        other.write_manifest(1, {}, {}, 1.0, meta("ambiguous", "someone"), {})


# -- acceptance 8: copies and renames ------------------------------------------------------------------------------
def test_a_copied_prefix_reads_its_own_objects_and_a_renamed_step_is_refused(s3):
    url, _ = s3
    src = store_at(url, "orig")
    for s in (1, 2):
        src.save(s, state(s), float(s), meta())
    dst = store_at(url, "copy")
    for key in src._listing():  # `aws s3 cp --recursive s3://hostile/orig s3://hostile/copy`
        dst.client.copy_object(Bucket="hostile", Key="copy/" + key[len("orig/"):],
                               CopySource={"Bucket": "hostile", "Key": key})
    assert dst.verify(2) == [] and dst.verify(1) == []
    assert all(p["key"].startswith("copy/") for u in dst.manifest(2)["units"].values() for p in u["pieces"])
    for key in src._listing():
        src.client.delete_object(Bucket="hostile", Key=key)
    step, got, _, _ = dst.load_latest()
    assert step == 2 and torch.equal(got["wte.weight"]["param"], state(2)["wte.weight"]["param"])
    for key in list(dst._listing()):  # step 2's folder renamed to step 7
        if "/step-0000000002/" in key:
            dst.client.copy_object(Bucket="hostile", Key=key.replace("step-0000000002", "step-0000000007"),
                                   CopySource={"Bucket": "hostile", "Key": key})
    with pytest.raises(CheckpointError, match="says step 2, not 7"):
        dst.manifest(7)
    assert dst.load_latest()[0] == 2 and "says step 2" in dst.verify(7)[0]


def test_older_formats_with_absolute_keys_still_read_and_copy(s3):
    url, _ = s3
    store = store_at(url, "format3")
    store.save(1, state(1), 1.0, meta())
    m = json.loads(store.client.get_object(Bucket="hostile", Key=store.manifest_key(1))["Body"].read())
    m["format"] = "hetspot-checkpoint/3"
    for u in m["units"].values():
        for p in u["pieces"]:
            p["key"] = store.step_dir(1) + p["key"]
            del p["tensors"]
    store.client.put_object(Bucket="hostile", Key=store.manifest_key(1), Body=json.dumps(m).encode())
    assert store.verify(1) == [] and store.load_latest()[0] == 1


# -- acceptance 9: content, not only bytes ------------------------------------------------------------------------
def _hand_written(store: S3Checkpoints, step: int, tensors: dict, region, opt: float = 3.0) -> str:
    """A piece and a manifest as a faulty or foreign writer would leave them (checksums right, content wrong)."""
    entry = store.put_piece(step, "w", region, tensors, "run-a")
    from orchestrator.state.manifest import stored

    m = {"format": "hetspot-checkpoint/4", "step": step, "optimizer_steps": opt, "written_at": 0.0,
         "meta": meta(), "model_units": {"w": [8, 16]},
         "units": {"w": {"shape": [8, 16], "pieces": [entry], "bytes": entry["bytes"]}}}
    store.client.put_object(Bucket="hostile", Key=store.manifest_key(step),
                            Body=json.dumps(stored(m, store.step_dir(step))).encode())
    return entry["key"]


@pytest.mark.parametrize("case", ["wrong-shape", "broadcastable", "transposed", "missing-moments"])
def test_a_piece_whose_content_is_not_its_region_is_refused(s3, case):
    """A piece too small for its region is refused from its manifest entry alone (its size follows from region and
    dtypes), before a byte is read; one of the right size but the wrong shape when its header is read."""
    url, _ = s3
    store = store_at(url, f"content-{case}")
    whole = ((0, 8), (0, 16))
    good = {k: torch.ones(8, 16) for k in ("param", "exp_avg", "exp_avg_sq")}
    tensors = {"wrong-shape": {k: torch.ones(6, 16) for k in good},
               "broadcastable": {k: torch.ones(1, 16) for k in good},
               "transposed": {k: torch.ones(16, 8) for k in good},
               "missing-moments": {"param": torch.ones(8, 16)}}[case]
    _hand_written(store, 1, good, whole)
    key = _hand_written(store, 2, tensors, whole)
    problems = store.verify(2)
    assert problems and key in problems[0], problems
    assert {"missing-moments": "lacks the optimizer's moments", "transposed": "its region"}.get(
        case, "cannot hold the region") in problems[0]
    with pytest.raises(CheckpointError) as e:
        store.load(2)
    assert e.value.refusal is Refusal.CORRUPT
    assert store.load_latest()[0] == 1


def test_the_writer_refuses_a_manifest_without_moments(s3):
    url, _ = s3
    store = store_at(url, "no-moments")
    entry = store.put_piece(1, "w", ((0, 4),), {"param": torch.ones(4)}, "run-a")
    with pytest.raises(CheckpointError, match="lack the optimizer's moments"):
        store.write_manifest(1, {"w": [4]}, {"w": [entry]}, 2.0, meta())
    assert store.complete_steps() == []


# -- acceptance 10: interrupted multipart uploads are aborted ------------------------------------------------------
def test_a_keeper_killed_mid_multipart_upload_leaves_no_upload_after_pruning(s3):
    url, _ = s3
    store = store_at(url, "multipart")
    store.save(4, state(4), 4.0, meta())
    from orchestrator.state.manifest import piece_key

    key = piece_key(store.step_dir(5), "wte.weight", ((0, 8), (0, 16)), "run-a")
    up = store.client.create_multipart_upload(Bucket="hostile", Key=key)  # the keeper died after one part
    store.client.upload_part(Bucket="hostile", Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"x" * 1024)
    assert len(store.client.list_multipart_uploads(Bucket="hostile", Prefix=store.dir).get("Uploads", [])) == 1
    for s in (6, 7):
        store.save(s, state(s), float(s), meta())
    pruned = store.keep_newest(1, identity())
    assert pruned.aborted_uploads == 1
    assert store.client.list_multipart_uploads(Bucket="hostile", Prefix=store.dir).get("Uploads", []) == []
    assert store.complete_steps() == [7]


# -- acceptance 12: the CLI answers in one line --------------------------------------------------------------------
def test_the_cli_answers_s3_refusals_in_one_line(s3, proxy, tmp_path, monkeypatch):
    for k, v in TEST_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # a throttled prefix: past the retries quickly
    store = store_at(proxy.url, "cli")
    store.save(1, state(1), 1.0, meta())
    uri, base = "s3://hostile/cli", ["--endpoint-url", proxy.url]
    cases = [  # (fault, argv, exit code, what the one line says)
        (("GET", "step-", "AccessDenied", ""), ["checkpoints", "verify", uri, *base], 2,
         "refused by S3 (AccessDenied)"),
        (("GET", "step-", "AccessDenied", ""), ["checkpoints", "export", uri, *base, "--out", str(tmp_path / "x")], 2,
         "refused by S3 (AccessDenied)"),
        (("GET", "", "AccessDenied", "list-type"), ["checkpoints", "list", uri, *base], 2, "listing the steps under"),
        (("GET", "", "AccessDenied", "list-type"), ["checkpoints", "verify", uri, *base], 2, "(AccessDenied)"),
        (("GET", "", "SlowDown", "list-type"), ["checkpoints", "rm", uri, *base, "--all", "--yes"], 2,
         "throttled the prefix past the retries"),
        (None, ["checkpoints", "export", "s3://hostile/empty", *base, "--out", str(tmp_path / "y")], 2,
         "no good step under s3://hostile/empty/;"),
        (None, ["checkpoints", "list", "s3://hostile/a/../b", *base], 2, "'.' or '..' segment"),
        (None, ["checkpoints", "list", "s3://hostile/a//b", *base], 2, "empty, '.' or '..' segment"),
    ]
    for fault, argv, code, needle in cases:
        proxy.clear()
        if fault:
            method, key, err, query = fault
            proxy.fail(method, key=key, code=err, query=query)
        res = runner.invoke(app, argv)
        assert res.exit_code == code, (argv, res.output)
        assert needle in _one_line(res), (argv, res.output)
        assert "  " not in res.output.strip().splitlines()[-1].split("error:")[-1].strip()  # no double space
    proxy.clear()
    assert store.verify(1) == []  # nothing was lost


# -- the resume contract: a resumed run restores one of its steps or stops; it never starts over ----------------
def resumed(proxy, prefix: str, group) -> TieredState:
    """A new controller's state plane for run r1 of `prefix` (its keepers gone: S3 is all there is), resuming."""
    s3 = S3Checkpoints(f"s3://hostile/{prefix}", proxy.url)
    return TieredState(1, s3, s3_every=1, keep=3, meta={"job": prefix, "run_id": "r1"}, model_units=model_units(LAYERS),
                       calls=group.calls, restore_from="s3", resuming=True,
                       restorer_kw={"retry_s": (0.01, 0.01, 0.01), "sleep": lambda s: None})


def deny_every_piece(proxy, s3a: S3Checkpoints, times: int | None) -> None:
    for step in s3a.complete_steps():
        for unit in s3a.manifest(step)["units"].values():
            for piece in unit["pieces"]:
                proxy.fail("GET", key=piece["key"].split("/", 1)[1], code="AccessDenied", times=times)


def test_a_resume_asks_again_where_s3_refused_every_read_once_and_restores_its_newest_step(s3, proxy):
    """Every piece's first GET denied: a restore that does not hold a run's word refuses steps 3, 2, 1 and 0 in
    turn and starts over from step 0 (what a resume did before); resuming, it asks again and restores step 3."""
    _, s3a, _, _ = trained(proxy.url, "resume-once")
    deny_every_piece(proxy, s3a, times=1)
    fresh = LocalGroup(NEW, LocalCalls(["a"]))
    plain = resumed(proxy, "resume-once", fresh)
    plain.restorer.resuming = False
    assert plain.restore(fresh) is None  # without the contract: started over, silently
    proxy.clear()
    deny_every_piece(proxy, s3a, times=1)
    new = LocalGroup(NEW, LocalCalls(["a"]))
    r = resumed(proxy, "resume-once", new).restore(new)
    assert r is not None and r.step == 3 and r.refused_steps == []
    assert_holds(new, 3)


def test_a_resume_that_cannot_read_its_run_stops_in_one_line_and_trains_nothing(s3, proxy):
    from orchestrator.errors import ResumeError

    _, s3a, _, _ = trained(proxy.url, "resume-never")
    deny_every_piece(proxy, s3a, times=None)
    new = LocalGroup(NEW, LocalCalls(["a"]))
    with pytest.raises(ResumeError) as e:
        resumed(proxy, "resume-never", new).restore(new)
    msg = str(e.value)
    assert "\n" not in msg and "cannot resume run r1" in msg and "step 3" in msg and "AccessDenied" in msg
    assert "nothing was trained" in msg and "--resume" in msg and "s3:GetObject" in msg
    assert not new.holds_state  # the fresh initial weights are not the run's state


def test_a_resume_asks_again_where_the_listing_was_refused_and_stops_where_it_stays_refused(s3, proxy):
    from orchestrator.errors import ResumeError

    trained(proxy.url, "resume-list")
    proxy.fail("GET", query="list-type", code="AccessDenied", times=1)
    new = LocalGroup(NEW, LocalCalls(["a"]))
    r = resumed(proxy, "resume-list", new).restore(new)
    assert r is not None and r.step == 3
    proxy.clear()
    proxy.fail("GET", query="list-type", code="AccessDenied")
    other = LocalGroup(NEW, LocalCalls(["a"]))
    with pytest.raises(ResumeError, match="listing its steps was refused"):
        resumed(proxy, "resume-list", other).restore(other)


# -- manifests no reader can be crashed by ------------------------------------------------------------------------
def _damaged(m: dict, damage: str) -> bytes:
    import orchestrator.state.manifest as manifest_module

    if damage == "nested-json":
        return b"[" * 200_000 + b"]" * 200_000
    if damage == "nested-meta":
        deep: dict = {}
        for _ in range(40):
            deep = {"x": deep}
        return json.dumps(m | {"meta": m["meta"] | {"extra": deep}}).encode()
    if damage == "nan-optimizer-steps":
        return json.dumps(m).replace('"optimizer_steps": 3.0', '"optimizer_steps": NaN').encode()
    if damage == "oversized":
        return json.dumps(m | {"padding": "x" * 5000}).encode()
    # huge-unit: a unit of 2^40 elements whose one piece says it is that large (12 TiB): self-consistent, and
    # nothing of the kind is in the bucket
    name = "wte.weight"
    m["model_units"][name] = m["units"][name]["shape"] = [1 << 40]
    piece = m["units"][name]["pieces"][0]
    width = sum(manifest_module.ITEMSIZE[d] for d in piece["tensors"].values())
    piece["region"], piece["bytes"] = [[0, 1 << 40]], 8 + 200 + width * (1 << 40)
    return json.dumps(m).encode()


@pytest.mark.parametrize("damage", ["nested-json", "nested-meta", "nan-optimizer-steps", "oversized", "huge-unit"])
def test_a_manifest_that_would_crash_a_reader_is_refused_in_one_line_everywhere(s3, damage, tmp_path, monkeypatch,
                                                                               caplog):
    """Deeply nested JSON (RecursionError in json), free-form meta nested past its cap, a NaN update count, a
    manifest over the size cap (lowered here) and a unit declared 2^40 elements large: every reader refuses that
    step by name and goes on with the previous one; pruning, the resume choice and the CLI never raise."""
    import orchestrator.state.manifest as manifest_module
    import orchestrator.state.s3_store as store_module

    url, _ = s3
    for k, v in TEST_ENV.items():
        monkeypatch.setenv(k, v)
    store = store_at(url, f"crash-{damage}")
    for s in (1, 2, 3):
        store.save(s, *model_state(s)[:1], float(s), model_state(s)[1])
    key = store.manifest_key(3)
    raw = store.client.get_object(Bucket="hostile", Key=key)["Body"].read()
    store.client.put_object(Bucket="hostile", Key=key, Body=_damaged(json.loads(raw), damage))
    if damage == "oversized":  # the cap, between the good manifests and this one
        monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", len(raw) + 2000)
        monkeypatch.setattr(store_module, "MAX_MANIFEST_BYTES", len(raw) + 2000)
    (st,) = [x for x in store.survey() if x.step == 3]
    assert not st.ok and key.rsplit("/", 2)[0] in st.reason and "\n" not in st.reason
    with caplog.at_level(logging.WARNING, logger="hetspot.checkpoints"):
        step, got, _, _ = store.load_latest()
    assert step == 2 and torch.equal(got["wte.weight"]["param"], model_state(2)[0]["wte.weight"]["param"])
    with pytest.raises(CheckpointError) as e:
        store.load(3)
    assert "\n" not in str(e.value)
    assert store.newest_whole()[0] == 2
    base = ["--endpoint-url", url]
    uri = f"s3://hostile/crash-{damage}"
    for argv, code in ((["checkpoints", "list", uri, *base], 0), (["checkpoints", "verify", uri, *base], 1),
                       (["checkpoints", "export", uri, *base, "--out", str(tmp_path / "hf")], 0)):
        res = runner.invoke(app, argv)
        assert res.exit_code == code and res.exception is None or isinstance(res.exception, SystemExit), \
            (argv, res.output)
        assert "Traceback" not in res.output and "step 3" in res.output or argv[1] == "list", (argv, res.output)
    assert (tmp_path / "hf" / "config.json").exists()  # exported from step 2
    store.keep_newest(1)  # pruning goes on
    assert store.newest_whole()[0] == 2


def test_the_tiling_check_takes_mixed_layouts_and_refuses_overlaps_and_holes():
    """Pieces tile a unit when they lie inside it, never overlap and cover it: slices of two TP degrees mixed are
    whole; equal volume with an overlap and a hole is not; 3,000 slices are checked on the grid of their cuts."""
    from orchestrator.state.manifest import _tiles

    shape = [64, 32]
    rows = [[[a, a + 16], [0, 32]] for a in (0, 16)] + [[[32, 64], [0, 16]], [[32, 64], [16, 32]]]
    assert _tiles(rows, shape)
    overlap_and_hole = [[[0, 32], [0, 32]], [[16, 48], [0, 32]]]  # rows 16-32 twice, 48-64 never
    assert not _tiles(overlap_and_hole, shape)
    assert not _tiles([[[0, 64], [0, 33]]], shape)  # outside
    many = [[[i, i + 1], [0, 8]] for i in range(3000)]
    assert _tiles(many, [3000, 8]) and not _tiles(many[:-1] + [[[0, 1], [0, 8]]], [3000, 8])


class _ZeroPiece:
    """A safetensors file of one float32 tensor of `numel` zeros, read as a stream (never whole in memory): its
    SHA256 and size as it goes."""

    def __init__(self, numel: int):
        header = json.dumps({"param": {"dtype": "F32", "shape": [numel], "data_offsets": [0, 4 * numel]}}).encode()
        header += b" " * (-len(header) % 8)
        self.head = len(header).to_bytes(8, "little") + header
        self.size, self.at = len(self.head) + 4 * numel, 0
        self.sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.at if n is None or n < 0 else min(n, self.size - self.at)
        out = (self.head[self.at:self.at + n] if self.at < len(self.head) else b"")
        out += bytes(n - len(out))
        self.at += n
        self.sha.update(out)
        return out


_MEASURE = """
import sys
from typer.main import get_command
from orchestrator.cli.main import app
cli = get_command(app)
def run(step):
    try:
        cli.main(["checkpoints", "verify", sys.argv[1], "--step", str(step), "--endpoint-url", sys.argv[2]])
    except SystemExit as e:
        assert e.code in (0, None), e.code
def kib(field):
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])
run(1)
rest = kib("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from now
run(2)
print("extra_kib", kib("VmHWM:") - rest)
"""


def test_verify_streams_a_1_gib_piece_in_bounded_memory(s3, tmp_path):
    """`hetspot checkpoints verify` of a step whose one piece is 1 GiB holds at most 64 MiB more than after
    verifying a small step: the piece is hashed and its header checked chunk by chunk, never held whole."""
    import subprocess
    import sys

    from boto3.s3.transfer import TransferConfig

    from orchestrator.state.manifest import stored

    url, _ = s3
    store = store_at(url, "one-gib")
    numel = 1 << 28  # 1 GiB of float32
    for step, n in ((1, 1024), (2, numel)):
        body = _ZeroPiece(n)
        key = f"{store.step_dir(step)}units/w/0-{n}.run-run-a.safetensors"
        store.client.upload_fileobj(body, "hostile", key, Config=TransferConfig(multipart_chunksize=64 << 20,
                                                                                max_concurrency=4))
        entry = {"key": key, "region": [[0, n]], "sha256": body.sha.hexdigest(), "bytes": body.size,
                 "tensors": {"param": "float32"}}
        m = {"format": "hetspot-checkpoint/4", "step": step, "optimizer_steps": 0.0, "written_at": 0.0,
             "meta": meta(), "model_units": {"w": [n]}, "units": {"w": {"shape": [n], "pieces": [entry],
                                                                        "bytes": body.size}}}
        store.client.put_object(Bucket="hostile", Key=store.manifest_key(step),
                                Body=json.dumps(stored(m, store.step_dir(step))).encode())
    out = subprocess.run([sys.executable, "-c", _MEASURE, "s3://hostile/one-gib", url], capture_output=True,
                         text=True, timeout=300, env={**os.environ, **TEST_ENV})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step 2: ok" in out.stdout
    extra_mib = int(out.stdout.split("extra_kib")[-1]) / 1024
    print(f"verify of a 1 GiB piece: {extra_mib:.1f} MiB over rest")
    assert extra_mib <= 64, extra_mib
    store.client.delete_object(Bucket="hostile", Key=key)  # moto holds it in memory


def test_without_the_multipart_listing_permission_pruning_and_rm_go_on_and_name_it(s3, proxy, monkeypatch, caplog):
    """A bucket policy without s3:ListBucketMultipartUploads: pruning still deletes the older steps and `rm` the
    step asked for; the warning names the permission (interrupted uploads stay billed until it is granted)."""
    for k, v in TEST_ENV.items():
        monkeypatch.setenv(k, v)
    store = store_at(proxy.url, "no-upload-listing")
    for s in (1, 2, 3):
        store.save(s, state(s), float(s), meta())
    proxy.fail("GET", query=r"(^|&)uploads(=|&|$)", code="AccessDenied")
    with caplog.at_level(logging.WARNING, logger="hetspot.checkpoints"):
        pruned = store.keep_newest(2)
    assert pruned.deleted == [1] and store.complete_steps() == [3, 2]
    assert any("s3:ListBucketMultipartUploads" in m for m in caplog.messages), caplog.messages
    res = runner.invoke(app, ["checkpoints", "rm", "s3://hostile/no-upload-listing", "--endpoint-url", proxy.url,
                              "--step", "2", "--yes"])
    assert res.exit_code == 0 and "deleted 1 step(s)" in res.output, res.output
    assert proxy.counts["faulted"] >= 2
    assert store.complete_steps() == [3]


def test_no_secret_in_an_endpoint_url_is_printed():
    """An endpoint URL's user info and query string never reach a message: the job file's validation, the CLI's
    and the S3 checks' errors go through `redact`."""
    from pydantic import ValidationError

    from orchestrator.job_spec import CheckpointSpec, format_validation
    from workers.s3_data import redact

    assert redact("cannot reach http://ak:hunter2@minio.local:9000/b?X-Amz-Signature=abc1 now") == \
        "cannot reach http://***@minio.local:9000/b?*** now"
    with pytest.raises(ValidationError) as e:
        CheckpointSpec(uri="s3://b/p", endpoint_url="ftp://ak:hunter2@minio.local")
    said = format_validation("job.yaml", e.value)  # what `hetspot submit` prints
    assert "hunter2" not in said and "ftp://***@minio.local" in said, said
    res = runner.invoke(app, ["checkpoints", "list", "s3://bkt/p", "--endpoint-url", "minio://ak:hunter2@h"])
    assert res.exit_code == 2 and "hunter2" not in res.output and "***@h" in res.output, res.output
    res = runner.invoke(app, ["checkpoints", "list", "s3://bkt/p", "--endpoint-url", "http://ak:hunter2@127.0.0.1:9"],
                        env={**TEST_ENV, "AWS_MAX_ATTEMPTS": "1"})
    assert res.exit_code == 2 and "hunter2" not in res.output and "cannot reach" in res.output, res.output


# -- one writer per run ------------------------------------------------------------------------------------------
def test_a_second_writer_of_a_run_is_refused_naming_the_first_and_takes_over_once_it_lapses(s3, monkeypatch):
    """Two jobs with one run id (`--resume` submitted twice): the second watches the lock, sees the first renew it
    and is refused in one line naming the first (its job, host, start) and how to take over; it writes nothing.
    Once the first stops renewing (it died, or hangs) its lock lapses and the second takes the run over; the
    first, if it was only stalled, writes no manifest after that. A job that ends releases the lock at once."""
    from orchestrator.errors import WriterConflict

    monkeypatch.setenv("HETSPOT_WRITER_TTL_S", "2")  # (30 s of renewals would take as long to watch)
    url, _ = s3
    calls, s3a, first, group = trained(url, "two-writers", steps=2)

    def job(run: str = "r1") -> TieredState:
        return TieredState(1, S3Checkpoints("s3://hostile/two-writers", url), s3_every=1, keep=3,
                           meta={"job": "two-writers", "run_id": run}, model_units=model_units(LAYERS),
                           calls=LocalCalls(["a"]), restore_from="s3")

    first.claim()
    second = job()
    with pytest.raises(WriterConflict) as e:
        second.claim()
    msg = str(e.value)
    assert "\n" not in msg and "run r1 of job 'two-writers'" in msg and "host " in msg and "started 20" in msg
    assert ".hetspot-writers/run-r1.json" in msg and "--resume" in msg
    assert second.writer is None
    first.writer.stall()  # the first job stops renewing: its lock lapses within the TTL
    t0 = time.monotonic()
    second.claim()
    assert time.monotonic() - t0 <= 2 + 2  # at most the TTL (and a poll) after the last renewal
    group.commit(2)
    first.after_step(group, 2)
    first.flush()
    assert first.uploads[-1].status == "failed" and "another writer" in first.uploads[-1].error
    assert "another writer" in (first.writer_lost() or "") and second.writer_lost() is None  # the controller stops
    assert 2 not in s3a.complete_steps()
    second.release()
    t0 = time.monotonic()
    third = job()
    third.claim()  # released at the end of a job: the run's next job does not wait
    assert time.monotonic() - t0 < 1.0
    third.release()
    other_run = job("r2")
    other_run.claim()  # another run on the prefix has a lock of its own
    other_run.release()


def test_a_piece_read_in_concurrent_ranges_is_the_piece_and_one_replaced_mid_read_is_refused(s3, proxy):
    """Above `part_bytes` a piece is read in ranged GETs over several connections: the same tensors as one GET.
    Every range asks for the version a HEAD saw first (If-Match): a piece replaced meanwhile is refused for this
    read, never stitched from two writes."""
    url, _ = s3
    writer = store_at(url, "ranged")
    writer.save(1, state(1, rows=64), 1.0, meta())
    one = store_at(proxy.url, "ranged")
    ranged = store_at(proxy.url, "ranged", part_bytes=1000, connections=4)
    before = proxy.counts["received"]
    got, _, nbytes = ranged.load(1)
    entry = ranged.manifest(1)["units"]["wte.weight"]["pieces"][0]
    assert proxy.counts["received"] - before >= -(-entry["bytes"] // 1000)  # a GET per range at least
    want, _, _ = one.load(1)
    for unit, tensors in want.items():
        for k, t in tensors.items():
            assert torch.equal(got[unit][k], t), (unit, k)
    original = writer.client.get_object(Bucket="hostile", Key=entry["key"])["Body"].read()
    calls = {"n": 0}
    real_get = ranged.client.get_object

    def replaced_after_the_head(**kw):
        calls["n"] += 1
        if calls["n"] == 1:  # another writer replaces the object between the HEAD and the ranges
            writer.client.put_object(Bucket="hostile", Key=entry["key"], Body=original[::-1])
        return real_get(**kw)

    ranged.client.get_object = replaced_after_the_head
    with pytest.raises(CheckpointError) as e:
        ranged.read_piece(1, entry)
    assert e.value.refusal is Refusal.UNREADABLE and "PreconditionFailed" in str(e.value)


def test_a_versioned_bucket_reads_the_versions_its_manifest_recorded_and_pruning_leaves_no_version(s3):
    """With versioning on, each piece's manifest entry records the version written; a reader reads that version
    even where the key was written again since (an operator's copy, a stray writer: the same size); pruning a step
    deletes every version and delete marker of it, so the old bytes are not kept (and billed) for ever."""
    url, _ = s3
    client = boto3.client("s3", endpoint_url=url, **CREDS)
    client.create_bucket(Bucket="versioned")
    client.put_bucket_versioning(Bucket="versioned", VersioningConfiguration={"Status": "Enabled"})
    store = S3Checkpoints("s3://versioned/job", client=client)
    for s in (1, 2, 3):
        store.save(s, state(s), float(s), meta())
    entry = store.manifest(3)["units"]["wte.weight"]["pieces"][0]
    assert entry.get("version")
    other = torch.zeros_like(state(3)["wte.weight"]["param"])
    client.put_object(Bucket="versioned", Key=entry["key"], Body=b"x" * entry["bytes"])  # the same size, not it
    got, _ = store.read_piece(3, entry)
    assert torch.equal(got["param"], state(3)["wte.weight"]["param"]) and not torch.equal(got["param"], other)
    assert store.keep_newest(1, identity()).deleted == [1, 2]
    left = client.list_object_versions(Bucket="versioned", Prefix="job/")
    kept = {v["Key"].split("/")[1] for v in left.get("Versions", []) + left.get("DeleteMarkers", [])}
    assert kept == {"step-0000000003"}, kept
    from pathlib import Path  # the lifecycle rule docs/recovery.md asks for is one S3 accepts

    rules = json.loads((Path(__file__).parents[1] / "deploy/aws/s3-lifecycle.json").read_text())
    client.put_bucket_lifecycle_configuration(Bucket="versioned", LifecycleConfiguration=rules)
    got = client.get_bucket_lifecycle_configuration(Bucket="versioned")["Rules"]
    assert any(r.get("NoncurrentVersionExpiration") for r in got)


def test_a_head_backs_off_at_the_throttling_scale_through_a_slowdown(s3, proxy, monkeypatch):
    """A 503 to a HEAD has no body, so botocore cannot tell SlowDown from another 503 and its retries (a few
    seconds in all) end inside a throttling episode that a GET or PUT outlasts: a drill's checkpoint gave up on
    its HEAD 2.5 s into 6 s of SlowDown. The store's HEADs back off at S3's throttling scale between rounds of
    botocore's retries. Here botocore makes one retry (AWS_MAX_ATTEMPTS=2, so it alone gives up at once) and the
    jitter is fixed at its middle: the HEAD is answered once the second round starts after the 1 s episode."""
    import random

    from orchestrator.state import s3_store

    for k, v in TEST_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    store = store_at(proxy.url, "slow-head")
    store.save(1, state(1), 1.0, meta())
    monkeypatch.setattr(random, "random", lambda: 0.5)  # waits 0.5, 1, 2, 4, 8 s between rounds
    proxy.slowdown(1.0)
    t0 = time.perf_counter()
    assert store.prepare_step(1, identity()) == "exists"  # its HEAD of the manifest, then the listing
    assert proxy.counts["throttled"] >= 2 and time.perf_counter() - t0 >= 1.0
    proxy.slowdown(30.0)  # past every round: refused as S3 refused it, not waited on forever
    monkeypatch.setattr(s3_store, "HEAD_RETRIES", 1)
    with pytest.raises(Exception, match="503"):
        store.prepare_step(1, identity())
