"""Standby pods (hot-swap): the pool's order and refusals, offers through the run directory's spares
file (as `multipod attach` writes them), the checks that refuse a spare that does not fit, and the
--spares flag's format."""
from __future__ import annotations

import re
import threading
import time

import pytest

from multipod.controller.cluster.pods import Cluster
from multipod.controller.cluster.spares import SPARES_FILE, Spare, SparePool, offer
from multipod.controller.commands import parse_spares
from multipod.controller.core.errors import RunError
from multipod.controller.core.run_config import ConfigError
from multipod.protos import PROTOCOL_VERSION, multipod_pb2 as pb
from tests.unit.controller.fakes import FakePod, make_config


def _pool(bad: set[str] = frozenset(), run_dir=None, poll_s: float = 60.0):
    refused: list[tuple[str, str]] = []

    def check(spare: Spare) -> None:
        if spare.name in bad:
            raise RunError(f"spare {spare.name} cannot take a slot: no")
    pool = SparePool(check, lambda spare, why: refused.append((spare.name, why)), run_dir=run_dir, poll_s=poll_s)
    return pool, refused


def test_spares_are_taken_first_offered_first_and_a_refused_one_is_named_and_dropped():
    pool, refused = _pool(bad={"b:2"})
    try:
        assert pool.add(["a:1"]) and not pool.add(["b:2"]) and pool.add(["c:3", "c:4"])
        assert not pool.add(["a:1"])      # offered twice: once is enough
        pool.offer(["d:5"])               # checked at the pool's next round
        assert len(pool) == 2
        pool.poll()
        assert refused == [("b:2", "spare b:2 cannot take a slot: no")]
        assert len(pool) == 3
        assert pool.take() == Spare(("a:1",)) and pool.take() == Spare(("c:3", "c:4"))
        assert pool.take() == Spare(("d:5",)) and pool.take() is None
    finally:
        pool.close()


def test_offers_in_the_run_directory_are_read_whole_lines_only(tmp_path):
    pool, refused = _pool(bad={"bad:1"}, run_dir=tmp_path)
    try:
        pool.poll()
        assert pool.take() is None                      # no file yet
        offer(tmp_path, ["x:1"])
        offer(tmp_path, ["bad:1"])
        with (tmp_path / SPARES_FILE).open("a") as f:
            f.write("y:1,y:2  # two hosts\nz:")         # z: is still being written
        pool.poll()
        assert pool.take() == Spare(("x:1",))
        assert pool.take() == Spare(("y:1", "y:2"))
        assert pool.take() is None and refused == [("bad:1", "spare bad:1 cannot take a slot: no")]
        with (tmp_path / SPARES_FILE).open("a") as f:
            f.write("9\n")
        pool.poll()
        assert pool.take() == Spare(("z:9",))
    finally:
        pool.close()


def test_a_line_of_the_spares_file_that_is_not_host_ports_is_refused_without_a_check(tmp_path):
    refused: list[tuple[str, str]] = []
    checked: list[str] = []
    pool = SparePool(lambda spare: checked.append(spare.name), lambda spare, why: refused.append((spare.name, why)),
                     run_dir=tmp_path, poll_s=60.0)
    try:
        (tmp_path / SPARES_FILE).write_text("node-7\nv:1,v:99999\nw:1\n")     # edited by hand
        pool.poll()
        assert refused == [("node-7", "'node-7' is not HOST:PORT"),
                           ("v:1,v:99999", "'v:99999': the port must be a number from 1 to 65535")]
        assert checked == ["w:1"] and pool.take() == Spare(("w:1",))
    finally:
        pool.close()


def test_the_pool_watches_the_file_on_its_own(tmp_path):
    pool, _ = _pool(run_dir=tmp_path, poll_s=0.01)
    try:
        offer(tmp_path, ["w:1"])
        deadline = time.monotonic() + 10
        while not len(pool) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(pool) == 1
    finally:
        pool.close()


def test_a_spare_is_ready_once_prepared_and_refused_if_that_fails(tmp_path):
    release, events = threading.Event(), []

    def prepare(spare: Spare) -> None:
        release.wait(10)
        if spare.name == "slow-bad:1":
            raise RunError("spare slow-bad:1 could not compile the run's programs: boom")
    offer(tmp_path, ["early:1"])            # offered before the run began: checked when the pool is made
    pool = SparePool(lambda spare: None, lambda spare, why: events.append(("refused", spare.name, why)),
                     lambda spare: events.append(("ready", spare.name)), prepare=prepare, run_dir=tmp_path,
                     poll_s=60.0, offers=[["given:1"], ["slow-bad:1"]])
    try:
        assert len(pool) == 0 and pool.take() is None and events == []     # compiling
        release.set()
        deadline = time.monotonic() + 10
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        why = "spare slow-bad:1 could not compile the run's programs: boom"
        assert sorted(events) == [("ready", "early:1"), ("ready", "given:1"), ("refused", "slow-bad:1", why)]
        assert {pool.take(), pool.take()} == {Spare(("early:1",)), Spare(("given:1",))} and pool.take() is None
    finally:
        pool.close()


def test_offer_refuses_what_is_not_a_list_of_host_ports(tmp_path):
    for hosts in ([], ["nohost"], ["a:1,b:2"], [""]):
        with pytest.raises(ValueError, match="HOST:PORT"):
            offer(tmp_path, hosts)
    assert not (tmp_path / SPARES_FILE).exists()


def _status(**fields) -> pb.StatusReply:
    base = dict(protocol_version=PROTOCOL_VERSION, pod_index=-1, spare=True, configured=False, num_devices=2)
    return pb.StatusReply(**{**base, **fields})


@pytest.mark.parametrize("fields,hosts,why", [
    ({}, ("a:1",), None),
    ({"protocol_version": PROTOCOL_VERSION + 1}, ("a:1",), "protocol"),
    ({"spare": False, "pod_index": 3}, ("a:1",), "serves pod 3 already (start a standby worker with --spare)"),
    ({"configured": True}, ("a:1",), "configured already"),
    ({"num_devices": 4}, ("a:1",), "it has 4 device(s), the run's pods have 2"),
    ({}, ("a:1", "a:2"), "it has 2 host(s), the run's pods have 1"),
])
def test_a_spare_that_does_not_fit_the_run_is_refused_with_why(fields, hosts, why):
    cluster = Cluster([FakePod(0), FakePod(1)], make_config())
    cluster.device_counts = [2, 2]
    spare = Spare(hosts)
    if why is None:
        cluster._check_spare_status(spare, _status(**fields))
        return
    with pytest.raises(RunError, match=re.escape(f"spare {spare.name} cannot take a slot: ") + ".*" + re.escape(why)):
        cluster._check_spare_status(spare, _status(**fields))


def test_the_spares_flag_takes_the_workers_format_and_the_run_s_host_count():
    assert parse_spares("a:1,b:1", 1) == [["a:1"], ["b:1"]]
    assert parse_spares("a:1,a:2;", 2) == [["a:1", "a:2"]]
    with pytest.raises(ConfigError, match="--spares.*2 host"):
        parse_spares("a:1,b:1", 2)


def test_attach_offers_to_a_run_directory_and_refuses_anything_else(tmp_path, capsys):
    import argparse

    from multipod.controller.commands import attach
    with pytest.raises(ConfigError, match="is not a run directory"):
        attach(argparse.Namespace(run_dir=str(tmp_path), worker="a:1"))
    assert not (tmp_path / SPARES_FILE).exists()
    (tmp_path / "config.json").write_text("{}")
    assert attach(argparse.Namespace(run_dir=str(tmp_path), worker="a:1, b:2")) == 0
    assert (tmp_path / SPARES_FILE).read_text() == "a:1,b:2\n"
    assert "offered a:1,b:2" in capsys.readouterr().out


@pytest.mark.parametrize("worker, message", [
    ("a:99999", "--worker: host 0: 'a:99999': the port must be a number from 1 to 65535"),
    ("a:1,foo", "--worker: host 1: 'foo' is not HOST:PORT"),
    (",", "--worker: give the standby pod's HOST:PORT"),
])
def test_attach_refuses_a_worker_that_is_not_host_port_naming_the_flag_and_offers_nothing(tmp_path, worker, message):
    import argparse

    from multipod.controller.commands import attach
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=re.escape(message)):
        attach(argparse.Namespace(run_dir=str(tmp_path), worker=worker))
    assert not (tmp_path / SPARES_FILE).exists()
