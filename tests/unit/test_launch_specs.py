"""The launcher's process plan: every process gets the BytePS environment it needs."""

import pytest
from byteps_espresso.deploy.emulate import Placement
from byteps_espresso.deploy.launch import (
    PS_COMMAND,
    build_parser,
    cluster_specs,
    free_port_pair,
    machine_specs,
)

from byteps_espresso.config import Config, ConfigError


def _plan(**kw):
    args = dict(machines=2, workers_per_machine=3, servers=2,
                base_env={"PATH": "/bin", "DMLC_WORKER_ID": "7", "ESPRESSO_SEED": "4"},
                root_port=9123)
    args.update(kw)
    return cluster_specs(["python", "train.py"], **args)


def test_local_plan_has_scheduler_servers_and_every_rank():
    specs = _plan(base_env={"PATH": "/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert [s.name for s in specs] == ["scheduler", "server 0", "server 1"] + [
        f"worker {r}" for r in range(6)]
    for spec in specs[:3]:
        assert spec.argv == PS_COMMAND
    configs = [Config.from_env(s.env) for s in specs]
    assert all(c.num_machines == 2 and c.num_servers == 2 and c.root_port == 9123
               for c in configs)
    assert [c.role.value for c in configs[:3]] == ["scheduler", "server", "server"]
    workers = configs[3:]
    assert [c.rank for c in workers] == list(range(6))
    assert [(c.machine_id, c.local_rank) for c in workers] == [
        (m, k) for m in range(2) for k in range(3)]
    assert all(s.argv == ("python", "train.py") for s in specs[3:])


def test_inherited_cluster_variables_are_replaced_and_knobs_kept():
    specs = _plan()
    assert specs[0].env["PATH"] == "/bin" and specs[0].env["ESPRESSO_SEED"] == "4"
    assert "DMLC_WORKER_ID" not in specs[0].env
    assert specs[-1].env["DMLC_WORKER_ID"] == "1"


def test_each_local_machine_gets_its_gpus_and_servers_none():
    specs = _plan(base_env={"CUDA_VISIBLE_DEVICES": "2,3,4,5,6,7",
                            "NVIDIA_VISIBLE_DEVICES": "all"})
    # Every process of a machine sees the machine's GPUs; its local rank picks one.
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs[3:]] == ["2,3,4"] * 3 + ["5,6,7"] * 3
    assert all(s.env["CUDA_VISIBLE_DEVICES"] == "" for s in specs[:3])
    assert not any("NVIDIA_VISIBLE_DEVICES" in s.env for s in specs)


def test_too_few_gpus_for_local_machines_are_shared():
    specs = _plan(base_env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs[3:]] == ["0,1,2"] * 3 + ["3,0,1"] * 3


BYTEPS_WORKER = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1",
                 "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
                 "DMLC_WORKER_ID": "1"}


def test_bpslaunch_starts_one_process_per_nvidia_visible_device_like_byteps():
    specs = machine_specs(["python", "train.py"],
                          {**BYTEPS_WORKER, "NVIDIA_VISIBLE_DEVICES": "0,1,2,3"})
    configs = [Config.from_env(s.env) for s in specs]
    assert [(c.local_size, c.local_rank, c.rank) for c in configs] == [
        (4, k, 4 + k) for k in range(4)]
    # No process is narrowed to one GPU: each sees the machine's and selects cuda:local_rank.
    assert not any("CUDA_VISIBLE_DEVICES" in s.env for s in specs)
    kept = machine_specs(["python", "train.py"], {**BYTEPS_WORKER, "BYTEPS_LOCAL_SIZE": "2",
                                                  "CUDA_VISIBLE_DEVICES": "4,5"})
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in kept] == ["4,5", "4,5"]


@pytest.mark.parametrize(("env", "gpus", "expected"), [
    ({"NVIDIA_VISIBLE_DEVICES": "GPU-aaa,GPU-bbb"}, [], 2),
    ({"NVIDIA_VISIBLE_DEVICES": "0,1,2,3", "BYTEPS_LOCAL_SIZE": "2"}, [], 2),
    ({"NVIDIA_VISIBLE_DEVICES": "all"}, ["0", "1", "2"], 3),
    ({"NVIDIA_VISIBLE_DEVICES": "all"}, [], 1),
    ({"NVIDIA_VISIBLE_DEVICES": "none"}, ["0"], 1),
    ({"NVIDIA_VISIBLE_DEVICES": "void"}, [], 1),
    ({}, ["0", "1"], 1),
])
def test_local_size_as_byteps_decides_it(env, gpus, expected):
    from byteps_espresso.deploy.launch import local_size

    assert local_size(Config.from_env({**BYTEPS_WORKER, **env}), gpus) == expected


def test_placement_sets_prefix_and_addresses():
    def place(role, index):
        host = {"scheduler": "10.1.0.1", "server": f"10.1.0.{2 + index}",
                "worker": f"10.1.0.{10 + index}"}[role]
        return Placement(("netns", role, str(index)), host, (("GLOO_SOCKET_IFNAME", "eth0"),))

    specs = _plan(place=place)
    assert all(s.env["DMLC_PS_ROOT_URI"] == "10.1.0.1" for s in specs)
    assert specs[1].argv[:3] == ("netns", "server", "0")
    assert specs[-1].env["DMLC_NODE_HOST"] == "10.1.0.11"
    assert specs[-1].argv == ("netns", "worker", "1", "python", "train.py")
    assert all(s.env["GLOO_SOCKET_IFNAME"] == "eth0" for s in specs)


def test_colocated_servers_share_the_machines_namespaces_and_addresses():
    from byteps_espresso.deploy.emulate import EmulatedCluster

    apart = EmulatedCluster(machines=2, servers=3, inter_gbps=1)
    together = EmulatedCluster(machines=2, servers=3, inter_gbps=1, colocate=True)
    assert apart.nodes == ["sched", "s0", "s1", "s2", "m0", "m1"]
    assert together.nodes == ["sched", "m0", "m1"]  # no namespace of a server's own
    for j, machine in enumerate((0, 1, 0)):  # server j on machine j mod machines
        server, worker = together.placement("server", j), together.placement("worker", machine)
        assert (server.prefix, server.host) == (worker.prefix, worker.host)
        assert apart.placement("server", j).host not in {
            apart.placement("worker", m).host for m in (0, 1)}


def test_colocate_without_emulate_is_refused_with_what_to_change(capsys):
    from byteps_espresso.deploy.launch import main

    assert main(["--local", "--colocate", "--", "python", "train.py"], environ={}) == 2
    assert "--colocate places the servers in emulated machines and needs --emulate" in \
        capsys.readouterr().err


@pytest.mark.parametrize(("kw", "message"), [
    ({"machines": 0}, "--machines"),
    ({"workers_per_machine": 0}, "--workers-per-machine"),
    ({"servers": 0}, "--servers"),
])
def test_bad_counts_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        _plan(**kw)


def test_async_training_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="BYTEPS_ENABLE_ASYNC='1' asks for asynchronous"):
        _plan(base_env={"BYTEPS_ENABLE_ASYNC": "1"})


def test_malformed_knob_is_named_before_anything_starts():
    with pytest.raises(ConfigError, match="ESPRESSO_TIMEOUT"):
        _plan(base_env={"ESPRESSO_TIMEOUT": "soon"})


def test_server_role_runs_the_ps_module_and_ignores_the_command():
    env = {"DMLC_ROLE": "server", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
           "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000"}
    (spec,) = machine_specs(["python", "train.py"], env)
    assert spec.argv == PS_COMMAND and spec.role == "server"


def test_command_after_double_dash_is_kept_whole():
    args = build_parser().parse_args(["--local", "--machines", "2", "--", "python", "t.py",
                                      "--machines", "9"])
    assert args.machines == 2
    assert args.command == ["--", "python", "t.py", "--machines", "9"]


def test_free_port_pair_is_bindable():
    import socket

    port = free_port_pair()
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", port))
        b.bind(("127.0.0.1", port + 1))


def test_auth_gives_every_process_one_new_secret_unless_one_is_set():
    plain = _plan()
    assert all("ESPRESSO_JOB_SECRET" not in s.env for s in plain)
    authed = _plan(auth=True)
    secrets = {s.env["ESPRESSO_JOB_SECRET"] for s in authed}
    assert len(secrets) == 1 and len(secrets.pop()) == 64  # 256 bits in hex
    assert _plan(auth=True)[0].env["ESPRESSO_JOB_SECRET"] != authed[0].env["ESPRESSO_JOB_SECRET"]
    given = _plan(auth=True, base_env={"PATH": "/bin", "ESPRESSO_JOB_SECRET": "x" * 20})
    assert {s.env["ESPRESSO_JOB_SECRET"] for s in given} == {"x" * 20}
    assert build_parser().parse_args(["--local", "--auth", "--", "python", "t.py"]).auth
