"""Chaos that removes Ray nodes (`--kill TYPE:RANK@WHEN:node`): parsed, refused off Ray, planned
within what the cluster can spare, fired only once the host is gone, and counted in the report."""

from __future__ import annotations

import pytest

from master.cli.chaos import ChaosAction, count_faults, given_plan, plan_kills
from master.cli.chaos_ray import ClusterNode, job_cpu, spare_ray_nodes
from master.cli.main import main
from master.config import parse_job_spec
from master.job.faults import FaultAction, FaultInjector, FaultSpecError, JobProgress, parse_fault
from master.job.host_faults import FAULT_FAILED
from master.nodes.model import Node, NodeState
from master.platform.api import HostRemoval, PlatformError

ALL = (ChaosAction.KILL, ChaosAction.FREEZE, ChaosAction.REMOVE_NODE)


def spec(**groups):
    data = {"name": "c", "command": ["true"], "max_relaunches": 50} | groups
    return parse_job_spec(data, source="test", base_dir="/tmp")


TF = spec(ps={"replicas": 1}, chief={"replicas": 1}, worker={"replicas": 2, "max_relaunches": 9})


def test_a_node_removal_is_parsed_and_never_aimed_at_the_master():
    fault = parse_fault("ps:0@30%:node")
    assert fault.action == FaultAction.REMOVE_NODE and (fault.node_type, fault.rank) == ("ps", 0)
    assert fault.describe() == "the host (Ray node) of ps-0 removed at 30% of the records done"
    with pytest.raises(FaultSpecError, match="master's Ray node is never removed"):
        parse_fault("master:0@30%:node")
    with pytest.raises(FaultSpecError, match="only :freeze takes a length"):
        parse_fault("ps:0@30%:node=5s")


def test_submit_refuses_a_node_removal_off_a_multi_node_ray_cluster(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("name: j\ncommand: [python, -c, pass]\nworker: {replicas: 1}\n")
    assert main(["submit", str(job), "--kill", "worker:0@50%:node"]) == 2
    err = capsys.readouterr().err
    assert "needs --platform ray --ray-address ADDRESS" in err and "not --platform local" in err
    assert main(["submit", str(job), "--platform", "ray", "--kill", "worker:0@5s:node"]) == 2
    assert "give --ray-address" in capsys.readouterr().err
    # dlrover chaos says the same before any run.
    assert main(["chaos", str(job), "--actions", "kill,node", "--by", "records"]) == 2
    assert "--actions node removes Ray nodes" in capsys.readouterr().err
    assert main(["chaos", str(job), "--kill", "worker:0@50%:node"]) == 2
    assert "--actions node removes Ray nodes" in capsys.readouterr().err


def test_removals_are_planned_only_where_the_cluster_can_spare_ray_nodes():
    with pytest.raises(ValueError, match="no Ray node to spare"):
        plan_kills(TF, 10, seed=0, actions=ALL, spare_ray_nodes=0)
    with pytest.raises(ValueError, match="can lose only 2 Ray nodes"):
        plan_kills(TF, 3, seed=0, actions=(ChaosAction.REMOVE_NODE,), spare_ray_nodes=2)
    seen = set()
    for seed in range(40):
        plan = plan_kills(TF, 10, seed=seed, actions=ALL, spare_ray_nodes=2)
        faults = [parse_fault(k) for k in plan.kills]
        removals = [f for f in faults if f.action == FaultAction.REMOVE_NODE]
        assert len(removals) <= 2, plan.kills
        assert all(f.node_type != "master" for f in removals)
        assert not removals or any("Ray node removals" in n for n in plan.notes)
        seen |= {f.action for f in faults}
    assert seen == set(FaultAction)
    # Weighted below a kill: over many faults, fewer removals than kills.
    plan = plan_kills(TF, 200, seed=3, actions=ALL, spare_ray_nodes=200)
    actions = [parse_fault(k).action for k in plan.kills]
    assert 0 < actions.count(FaultAction.REMOVE_NODE) < actions.count(FaultAction.KILL)


def test_what_a_ray_cluster_can_spare():
    head = ClusterNode("h", 0.0, head=True)
    nodes = [head, ClusterNode("a", 1.0), ClusterNode("b", 1.0), ClusterNode("c", 1.0)]
    assert job_cpu(TF) == pytest.approx(0.05)  # 4 nodes and a standby PS at 0.01 CPU
    assert spare_ray_nodes(nodes, here="h", demand_cpu=job_cpu(TF)) == 2  # one must be left
    assert spare_ray_nodes(nodes, here="a", demand_cpu=0.05) == 2  # this machine's: never
    assert spare_ray_nodes(nodes, here="h", demand_cpu=2.5) == 0  # the job needs all 3 CPUs
    big = spec(worker={"replicas": 2, "cpu": 1})
    assert spare_ray_nodes(nodes, here="h", demand_cpu=job_cpu(big)) == 1
    # A head with CPUs holds ranks too but is never removed.
    assert spare_ray_nodes([ClusterNode("h", 4.0, head=True), ClusterNode("a", 1.0)], "h", 1) == 1


def test_a_given_plan_is_checked_and_kept_in_order():
    plan = given_plan(TF, ["ps:0@30%:node", "worker:0@50%:freeze=3s", "worker:1@70%"])
    assert plan.kills == ("ps:0@30%:node", "worker:0@50%:freeze=3s", "worker:1@70%")
    assert plan.removes_nodes and plan.trigger.value == "records"
    assert not given_plan(TF, ["worker:1@step=5"]).removes_nodes
    with pytest.raises(FaultSpecError):
        given_plan(TF, ["worker:1@soon"])


def test_the_report_counts_removals_that_went_and_not_those_that_failed():
    def fault(reason, action, node_id=1):
        return {
            "kind": "fault",
            "reason": reason,
            "message": reason,
            "node_id": node_id,
            "details": {"action": action},
        }

    events = [
        {"kind": "fault_started", "reason": "", "message": "", "node_id": 1, "details": {}},
        fault("fault_injection", "node", 1),
        fault(FAULT_FAILED, "node", 2),
        fault("fault_injection", "kill", 3),
    ]
    count = count_faults(events)
    assert len(count.fired) == 2 and count.removed == 1 and count.failed == [FAULT_FAILED]


class _Removal(HostRemoval):
    def __init__(self):
        self.host, self.result = "Ray node 10.0.0.2 [abc]", None

    def outcome(self):
        if self.result:
            self.details = {"ray_node": "abc", "raylet_killed_at": 12.5}
        return self.result


class _Platform:
    """Removes hosts when asked, refusing the node ids in `refuse`."""

    def __init__(self, refuse=()):
        self.removals, self.refuse = {}, set(refuse)

    def remove_host(self, node_id):
        if node_id in self.refuse:
            raise PlatformError("Ray node 10.0.0.1 holds this job's master")
        self.removals[node_id] = _Removal()
        return self.removals[node_id]


class _Sharding:
    """No node holds shards (a PS target never waits for its first step)."""

    def holds_shards(self, node_id):
        return False

    def keep_work_for(self, node_id, datasets=None):
        pass


def _injector(faults, nodes, platform):
    events = []

    class _Nodes:
        def current(self, kind, rank):
            return next((n for n in nodes if (n.type, n.rank) == (kind, rank)), None)

        def all_current(self):
            return list(nodes)

    injector = FaultInjector(
        [parse_fault(f) for f in faults],
        _Nodes(),
        platform,
        sharding=_Sharding(),
        coordinator=lambda: None,
        catch_up_positions=lambda: 0,
        emit=lambda kind, message, node=None, reason="", **d: events.append((kind, reason, d)),
        save=lambda: None,
    )
    return injector, events


def _ps(node_id):
    return Node("ps", 0, node_id, state=NodeState.RUNNING)


def test_a_removal_fires_only_once_its_host_is_gone_and_a_refused_one_is_skipped():
    platform = _Platform()
    injector, events = _injector(["ps:0@30s:node"], [_ps(7)], platform)
    progress = lambda: JobProgress(0.0, 31.0, 0)  # noqa: E731
    injector.tick(progress)
    assert injector.fired == [0] and [e[0] for e in events] == ["fault_started"]
    injector.tick(progress)  # under way: not said fired yet
    assert [e[1] for e in events if e[0] == "fault"] == []
    platform.removals[7].result = True
    injector.tick(progress)
    (fired,) = [e for e in events if e[0] == "fault"]
    assert fired[1] == "fault_injection" and fired[2]["action"] == "node"
    assert fired[2]["raylet_killed_at"] == 12.5 and fired[2]["host"].startswith("Ray node")

    # Refused (its Ray node also holds the master): skipped, as a target not running.
    injector, events = _injector(["ps:0@30s:node"], [_ps(8)], _Platform(refuse={8}))
    injector.tick(progress)
    assert [(k, r) for k, r, _ in events] == [("fault", "skipped")]


def test_a_removal_that_does_not_take_is_failed_and_one_under_way_at_the_end_not_fired():
    platform = _Platform()
    injector, events = _injector(["ps:0@30s:node"], [_ps(7)], platform)
    injector.tick(lambda: JobProgress(0.0, 31.0, 0))
    platform.removals[7].result, platform.removals[7].error = False, "Ray still had it alive"
    injector.tick(lambda: JobProgress(0.0, 32.0, 0))
    assert [(k, r) for k, r, _ in events if k == "fault"] == [("fault", FAULT_FAILED)]

    platform = _Platform()
    injector, events = _injector(["ps:0@30s:node"], [_ps(7)], platform)
    injector.tick(lambda: JobProgress(0.0, 31.0, 0))
    injector.report_unfired(reports_progress=True)
    assert [(k, r) for k, r, _ in events if k == "fault"] == [("fault", "not_fired")]


def test_on_a_ray_cluster_random_plans_remove_ray_nodes_by_default(tmp_path, monkeypatch, capsys):
    from master.cli import chaos, chaos_ray

    job = tmp_path / "job.yaml"
    job.write_text("name: j\ncommand: [python, -c, pass]\nworker: {replicas: 2}\n")
    nodes = [ClusterNode("h", 0.0, head=True), ClusterNode("a", 1.0), ClusterNode("b", 1.0)]
    monkeypatch.setattr(chaos_ray, "survey", lambda address: (nodes, "h"))
    plans = []

    def run_chaos(job_yaml, spec, plan, out_dir, baseline, out, submit_args):
        plans.append((plan, submit_args))
        raise RuntimeError("not run here")

    monkeypatch.setattr(chaos, "run_chaos", run_chaos)
    ray = ["--platform", "ray", "--ray-address", "10.0.0.1:6379", "--by", "records"]
    assert main(["chaos", str(job), "--kills", "12", "--seed", "1", *ray]) == 1
    plan, submit_args = plans[-1]
    assert submit_args == ("--platform", "ray", "--ray-address", "10.0.0.1:6379")
    assert 0 < sum(k.endswith(":node") for k in plan.kills) <= 1  # one of two Ray nodes
    assert "the job can lose 1 of them" in capsys.readouterr().out
    # Asked for kills only, or on the local platform: no removal.
    assert main(["chaos", str(job), "--kills", "12", "--actions", "kill", *ray]) == 1
    assert not plans[-1][0].removes_nodes
    assert main(["chaos", str(job), "--kills", "12", "--by", "records"]) == 1
    assert not plans[-1][0].removes_nodes and plans[-1][1] == ("--platform", "local")
