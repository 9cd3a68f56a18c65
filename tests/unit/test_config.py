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


def test_every_variable_is_in_the_readme_table():
    table = markdown_table()
    with open("README.md", encoding="utf-8") as fh:
        readme = fh.read()
    for var in VARIABLES:
        assert f"`{var.name}`" in table
        assert f"`{var.name}`" in readme, f"README's configuration table lacks {var.name}"
