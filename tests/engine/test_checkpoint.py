
import pytest

from rlflow.engine import checkpoint


def write(root, step, keep=3):
    tmp = checkpoint.begin(root, step)
    (tmp / "model.safetensors").write_bytes(b"x" * step)
    return checkpoint.commit(root, tmp, step, {"step": step}, keep)


def test_commit_is_complete_and_latest_points_at_it(tmp_path):
    final = write(tmp_path, 2)
    assert checkpoint.problem(final) is None
    assert (tmp_path / "latest").read_text() == "step_000002"
    assert not list(tmp_path.glob(".tmp-*"))
    assert checkpoint.read_driver_state(final) == {"step": 2}


def test_auto_resume_skips_partial_and_corrupt(tmp_path, caplog):
    write(tmp_path, 2)
    write(tmp_path, 4)
    (tmp_path / "step_000004" / "model.safetensors").write_bytes(b"short")  # truncated file
    (tmp_path / "step_000006").mkdir()  # a crash before COMPLETE
    checkpoint.begin(tmp_path, 8)  # an unfinished temp dir is never considered
    assert checkpoint.find_resume(tmp_path, "auto") == tmp_path / "step_000002"
    assert "wrong size" in caplog.text and "no COMPLETE marker" in caplog.text


def test_retention_keeps_last_k(tmp_path):
    for step in (1, 2, 3, 4):
        write(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000003", "step_000004"]


def test_resume_never_and_explicit(tmp_path):
    final = write(tmp_path, 1)
    assert checkpoint.find_resume(tmp_path, "never") is None
    assert checkpoint.find_resume(tmp_path, str(final)) == final
    assert checkpoint.find_resume(tmp_path / "missing", "auto") is None
    (final / "COMPLETE").write_text("{not json")
    try:
        checkpoint.find_resume(tmp_path, str(final))
    except FileNotFoundError as e:
        assert "unreadable" in str(e)
    else:
        raise AssertionError("a corrupt explicit checkpoint must fail")


class Payload:
    """An object a malicious checkpoint could carry: unpickling it would run code."""

    def __reduce__(self):
        return (print, ("unpickled",))


def test_optimizer_shards_load_plain_data_only(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from rlflow.engine.checkpoint import load_shards

    dcp.save({"w": torch.ones(3), "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}, checkpoint_id=tmp_path / "ok")
    state = {"w": torch.zeros(3), "groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}  # the structure it was saved with
    load_shards(state, tmp_path / "ok")
    assert torch.equal(state["w"], torch.ones(3)) and state["groups"] == [{"lr": 0.1, "betas": (0.9, 0.99)}]
    dcp.save({"w": torch.ones(3), "evil": Payload()}, checkpoint_id=tmp_path / "evil")
    with pytest.raises(dcp.api.CheckpointException) as failed:  # DCP wraps each rank's error
        load_shards({"w": torch.zeros(3), "evil": None}, tmp_path / "evil")
    assert "Weights only load failed" in repr(failed.value.failures)


def test_the_disk_check_counts_the_model_and_warns_before_a_run_that_would_not_fit(model_dir, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    n = checkpoint.model_parameters(model_dir)
    assert n == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    assert checkpoint.disk_shortfall(tmp_path / "ckpt", n, keep_last=2, copies=1) is None
    huge = shutil.disk_usage(tmp_path).free // checkpoint.BYTES_PER_PARAMETER  # one checkpoint fills the disk
    why = checkpoint.disk_shortfall(tmp_path / "ckpt", huge, keep_last=2, copies=1)
    assert why and "2 kept + 1 being written + 1 copied" in why and "trainer.log_checkpoint=false" in why
