"""End to end: the overlapped step (dcn.overlap) against the fused one with `multipod local`, tiny
model. Both keep the pods bitwise identical at every step and give the same losses to float
tolerance; three pods (reduce-scatter + all-gather) with overlap on stay identical too. Chunks
zstd-packed (dcn.lossless) train bitwise like raw ones."""
import pytest

from tests.helpers import same_losses, train_identical_pods

STEPS = 10


def _run(run_dir, pods: int, overlap: bool, *settings: str) -> list[dict]:
    return train_identical_pods(run_dir, pods, STEPS, "--seed", "3",
                                settings=(f"dcn.overlap={str(overlap).lower()}", *settings))


@pytest.fixture(scope="module")
def fused(tmp_path_factory) -> list[dict]:
    """2 pods, the fused step, chunks raw: the reference of both tests below."""
    return _run(tmp_path_factory.mktemp("fused"), 2, False, "dcn.lossless=\"off\"")


def test_overlap_on_and_off_give_the_same_losses_with_identical_pods(fused, tmp_path):
    overlapped = _run(tmp_path / "overlapped", 2, True)
    same_losses(overlapped, fused, rel=1e-4)
    for a, b in zip(overlapped, fused):
        assert a["dcn_bytes_sent"] == b["dcn_bytes_sent"] > 0
    assert overlapped[-1]["loss"] < overlapped[0]["loss"]
    # Every pod reports the exposed part of its exchange. Its size is a timing, for bench/, not
    # for a test: when dispatch outlasts a tiny backward pass it can exceed compute + exchange.
    for r in overlapped:
        for pod in r["pods"]:
            assert pod["exposed_exchange_s"] >= 0.0


def test_packed_chunks_train_bitwise_like_raw_ones(fused, tmp_path):
    # dcn.lossless = on: every chunk of 16 KiB or more (the tiny model's embedding, MLP and
    # attention leaves) crosses the data plane zstd-packed, and unpacks bit for bit.
    packed = _run(tmp_path, 2, False, "dcn.lossless=\"on\"")
    assert [r["checksums"] for r in packed] == [r["checksums"] for r in fused]
    assert [r["loss"] for r in packed] == [r["loss"] for r in fused]
    assert all(pod["dcn_packed"] for r in packed for pod in r["pods"])
    assert not any(pod["dcn_packed"] for r in fused for pod in r["pods"])
    assert "zstd-packed" in (tmp_path / "worker-0.log").read_text()


@pytest.mark.slow
def test_three_pods_with_overlap_stay_identical(tmp_path):
    # Slow: 3 pods over the data plane are in the default run without overlap
    # (tests/e2e/test_dcn_local.py), overlap with 2 pods above, and an exchange taking the leaves
    # in a given order on 3 pods in tests/unit/pod_worker/test_dcn.py.
    records = _run(tmp_path, 3, True, "data.global_batch=6")
    assert records[-1]["loss"] < records[0]["loss"]
