"""Config: every variable parsed once, errors name the variable."""

import pytest

from byteps_espresso.config import VARIABLES, Config, ConfigError, Role, markdown_table

BASE = {
    "DMLC_ROLE": "worker",
    "DMLC_NUM_WORKER": "2",
    "DMLC_NUM_SERVER": "1",
    "DMLC_PS_ROOT_URI": "127.0.0.1",
    "DMLC_PS_ROOT_PORT": "9100",
}


def test_worker_rank_is_derived_like_byteps():
    cfg = Config.from_env({**BASE, "DMLC_WORKER_ID": "1", "BYTEPS_LOCAL_SIZE": "4",
                           "BYTEPS_LOCAL_RANK": "2"})
    assert cfg.role is Role.WORKER
    assert cfg.world_size == 8
    assert cfg.rank == 1 * 4 + 2
    assert cfg.store_port == 9101


@pytest.mark.parametrize("missing", ["DMLC_NUM_WORKER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT"])
def test_missing_required_variable_is_named(missing):
    env = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(ConfigError, match=missing):
        Config.from_env(env)


@pytest.mark.parametrize(("name", "value"), [
    ("DMLC_ROLE", "boss"),
    ("DMLC_NUM_WORKER", "zero"),
    ("DMLC_NUM_WORKER", "0"),
    ("DMLC_PS_ROOT_PORT", "70000"),
    ("ESPRESSO_TIMEOUT", "-1"),
    ("ESPRESSO_BIND_ALL", "maybe"),
    ("ESPRESSO_LOG_LEVEL", "chatty"),
    ("ESPRESSO_DEVICE_KERNELS", "cuda"),
])
def test_malformed_variable_is_named(name, value):
    with pytest.raises(ConfigError, match=name):
        Config.from_env({**BASE, name: value})


def test_index_out_of_range_says_which_bound():
    with pytest.raises(ConfigError, match=r"DMLC_WORKER_ID=2.*DMLC_NUM_WORKER=2"):
        Config.from_env({**BASE, "DMLC_WORKER_ID": "2"})
    with pytest.raises(ConfigError, match="BYTEPS_LOCAL_RANK"):
        Config.from_env({**BASE, "BYTEPS_LOCAL_SIZE": "2", "BYTEPS_LOCAL_RANK": "2"})


def test_binds_only_the_configured_address_by_default():
    cfg = Config.from_env({**BASE, "DMLC_NODE_HOST": "127.0.0.5"})
    assert cfg.bind_host() == "127.0.0.5"
    assert Config.from_env({**BASE, "ESPRESSO_BIND_ALL": "1"}).bind_host() == "0.0.0.0"
    assert Config.from_env({**BASE, "DMLC_INTERFACE": "lo"}).bind_host() == "127.0.0.1"
    with pytest.raises(ConfigError, match="DMLC_INTERFACE"):
        Config.from_env({**BASE, "DMLC_INTERFACE": "nosuchif0"}).bind_host()


def test_as_env_round_trips():
    cfg = Config.from_env({**BASE, "BYTEPS_LOCAL_SIZE": "2", "ESPRESSO_BIND_ALL": "true"})
    assert Config.from_env(cfg.as_env()) == cfg


def test_the_startup_budget_is_fp32_iterations_or_none():
    assert Config.from_env(BASE).startup_budget == 10.0
    unlimited = Config.from_env({**BASE, "ESPRESSO_STARTUP_BUDGET": "none"})
    assert unlimited.startup_budget is None
    assert Config.from_env(unlimited.as_env()) == unlimited
    assert Config.from_env({**BASE, "ESPRESSO_STARTUP_BUDGET": "0"}).startup_budget == 0.0
    with pytest.raises(ConfigError, match=r"ESPRESSO_STARTUP_BUDGET.*>= 0, or `none`"):
        Config.from_env({**BASE, "ESPRESSO_STARTUP_BUDGET": "-1"})


def test_every_variable_is_in_the_readme_table():
    table = markdown_table()
    with open("README.md", encoding="utf-8") as fh:
        readme = fh.read()
    for var in VARIABLES:
        assert f"`{var.name}`" in table
        assert f"`{var.name}`" in readme, f"README's configuration table lacks {var.name}"


def test_readme_holds_the_generated_tables_verbatim():
    with open("README.md", encoding="utf-8") as fh:
        assert markdown_table() in fh.read(), "regenerate it: espresso config --markdown"


# ---- every field is read --------------------------------------------------------------------
_PACKAGE_DIRS = ("byteps_espresso", "worker", "server", "kernels", "deploy")


def _config_readers() -> dict[str, set[str]]:
    """Config's methods and properties -> the fields they read (``self.<field>``)."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path("byteps_espresso/config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    return {fn.name: {a.attr for a in ast.walk(fn) if isinstance(a, ast.Attribute)
                      and isinstance(a.value, ast.Name) and a.value.id == "self"}
            for fn in cls.body if isinstance(fn, ast.FunctionDef)}


def _read_outside_config() -> set[str]:
    """Attributes read from a Config (``cfg.x``, ``config.x``, ``<...>.cfg.x``) outside
    config.py, in the installed package's sources."""
    import ast
    from pathlib import Path

    found = set()
    for folder in _PACKAGE_DIRS:
        for path in Path(folder).rglob("*.py"):
            if path.as_posix() == "byteps_espresso/config.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Attribute):
                    continue
                owner = node.value
                if (isinstance(owner, ast.Name) and owner.id in ("cfg", "config")) or (
                        isinstance(owner, ast.Attribute) and owner.attr == "cfg"):
                    found.add(node.attr)
    return found


def test_every_config_field_is_read_by_the_package():
    from dataclasses import fields

    outside = _read_outside_config()
    readers = _config_readers()
    used, todo = set(outside), [m for m in readers if m in outside]
    while todo:  # what a method used outside reads, also through the methods it calls
        method = todo.pop()
        for name in readers[method] - used:
            used.add(name)
            if name in readers:
                todo.append(name)
    unread = [f.name for f in fields(Config) if f.name not in used]
    assert not unread, (f"Config fields read by nothing outside config.py: {unread}; wire "
                        "them or remove their variables")
    import byteps_espresso.config as module  # `config.X` may also name the module's own X

    unknown = outside - {f.name for f in fields(Config)} - set(readers) - set(dir(module))
    assert not unknown, f"reads of Config attributes that do not exist: {unknown}"


# ---- addresses ------------------------------------------------------------------------------
def test_address_follows_ps_lite_order():
    from byteps_espresso.config import interfaces

    node = Config.from_env({**BASE, "DMLC_NODE_HOST": "127.0.0.1", "DMLC_INTERFACE": "lo"})
    assert node.address().reason == "DMLC_NODE_HOST" and node.address().interface == "lo"
    by_if = Config.from_env({**BASE, "DMLC_INTERFACE": "lo"}).address()
    assert (by_if.host, by_if.reason) == ("127.0.0.1", "DMLC_INTERFACE")
    routed = Config.from_env(BASE).address()  # the root URI is loopback: so is the route
    assert routed.host == "127.0.0.1" and "route to DMLC_PS_ROOT_URI" in routed.reason
    outside = [(n, a) for n, a in interfaces() if not a.startswith("127.")]
    if outside:  # a root on another interface's address is reached through that interface
        name, address = outside[0]
        other = Config.from_env({**BASE, "DMLC_PS_ROOT_URI": address}).address()
        assert (other.host, other.interface) == (address, name)
        lost = Config.from_env({**BASE, "DMLC_PS_ROOT_URI": "no-such-host.invalid"}).address()
        assert lost.host == address and "first non-loopback" in lost.reason


def test_gloo_and_nccl_use_the_advertised_interface_unless_set():
    cfg = Config.from_env({**BASE, "DMLC_INTERFACE": "lo"})
    assert cfg.socket_interfaces() == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    mine = Config.from_env({**BASE, "DMLC_INTERFACE": "lo", "GLOO_SOCKET_IFNAME": "eth7",
                            "NCCL_SOCKET_IFNAME": "ib0"})
    assert mine.socket_interfaces() == {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "ib0"}
    nat = Config.from_env({**BASE, "DMLC_NODE_HOST": "203.0.113.9"})  # on no local interface
    assert nat.socket_interfaces() == {}


def test_unknown_interface_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"DMLC_INTERFACE='nosuchif0'.*has: lo"):
        Config.from_env({**BASE, "DMLC_INTERFACE": "nosuchif0"}).address()


# ---- BytePS variables -----------------------------------------------------------------------
def test_byteps_log_level_is_honoured_and_espresso_wins():
    assert Config.from_env({**BASE, "BYTEPS_LOG_LEVEL": "TRACE"}).log_level == "DEBUG"
    assert Config.from_env({**BASE, "BYTEPS_LOG_LEVEL": "fatal"}).log_level == "CRITICAL"
    both = Config.from_env({**BASE, "BYTEPS_LOG_LEVEL": "DEBUG", "ESPRESSO_LOG_LEVEL": "ERROR"})
    assert both.log_level == "ERROR"
    with pytest.raises(ConfigError, match="BYTEPS_LOG_LEVEL='loud'"):
        Config.from_env({**BASE, "BYTEPS_LOG_LEVEL": "loud"})


def test_async_training_is_refused_because_it_would_change_results():
    with pytest.raises(ConfigError, match=r"BYTEPS_ENABLE_ASYNC='1'.*asynchronous.*Unset it"):
        Config.from_env({**BASE, "BYTEPS_ENABLE_ASYNC": "1"})
    assert Config.from_env({**BASE, "BYTEPS_ENABLE_ASYNC": "0"}).ignored == ()


def test_unsupported_variables_get_one_warning_each():
    from byteps_espresso.config import UNSUPPORTED

    env = {**BASE, "DMLC_ENABLE_RDMA": "1", "PS_VERBOSE": "2", "BYTEPS_NUMA_ON": "0"}
    warnings = Config.from_env(env).ignored_warnings()
    assert len(warnings) == 2  # BYTEPS_NUMA_ON=0 asks for nothing
    assert warnings[0].startswith("DMLC_ENABLE_RDMA='1' is ignored: it asks for RDMA")
    assert "ESPRESSO_LOG_LEVEL=DEBUG" in warnings[1]
    names = [u.name for u in UNSUPPORTED]
    assert len(set(names)) == len(names) and not set(names) & {v.name for v in VARIABLES}
