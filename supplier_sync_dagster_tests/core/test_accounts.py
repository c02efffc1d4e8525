"""The suppliers file: accounts resolved, and one clear error naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from supplier_sync_dagster.core.accounts import find_account, load_accounts, parse_accounts
from supplier_sync_dagster.core.errors import ConfigError
from supplier_sync_dagster.core.records.gates import GateThresholds


def _file(**acme_eu: Any) -> dict[str, Any]:
    return {
        "suppliers": {
            "acme": {
                "supplier_id": 1001,
                "base_url": "https://api.acme.example",
                "accounts": {
                    "eu": {"api_key_env": "ACME_EU_KEY", "rate_limit_rps": 20, **acme_eu},
                    "us": {
                        "api_key_env": "ACME_US_KEY",
                        "schedules": {"incremental": None},
                        "city_threads": 2,
                    },
                },
            },
            "globex": {
                "supplier_id": 2002,
                "simulator": {"seed": 7, "cities": 5, "hotels": 300, "profile": "clean"},
                "accounts": {"main": {"simulator_profile": "hostile"}},
            },
        }
    }


def test_accounts_are_resolved_in_file_order():
    accounts = parse_accounts(_file(thresholds={"max_bad_ratio": 0.1, "quiet_windows": 3}))
    assert [a.code for a in accounts] == ["acme.eu", "acme.us", "globex.main"]
    eu, us, main = accounts
    assert (eu.supplier_id, us.supplier_id, main.supplier_id) == (1001, 1001, 2002)
    assert eu.task_codes == ("acme.eu.full", "acme.eu.incremental", "acme.eu.compensation")
    assert eu.rate_limit_rps == 20 and us.rate_limit_rps == 50 and eu.page_size == 100
    assert us.schedules.incremental is None and us.schedules.full == "0 2 * * *"
    assert (eu.city_threads, us.city_threads) == (1, 2)
    assert eu.gate_thresholds() == GateThresholds(max_bad_ratio=0.1, quiet_windows=3)
    assert isinstance(eu.gate_thresholds().quiet_windows, int)
    assert us.gate_thresholds() == GateThresholds()
    assert main.base_url is None and main.simulator.seed == 7
    assert main.simulator_profile == "hostile" and eu.simulator_profile == "flaky"
    assert find_account(accounts, "acme.us") is us
    with pytest.raises(ConfigError, match="no account 'acme.xx'.*known: acme.eu, acme.us"):
        find_account(accounts, "acme.xx")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rate_limit_rps": 0}, r"suppliers\.acme\.accounts\.eu\.rate_limit_rps: .*greater than 0"),
        ({"page_size": 501}, r"accounts\.eu\.page_size: .*less than or equal to 500"),
        ({"api_key": "sk-live-123"}, r"accounts\.eu\.api_key: Extra inputs are not permitted"),
        (
            {"api_key_env": "sk-live-123"},
            r"accounts\.eu\.api_key_env: not an environment variable name \(.*key itself",
        ),
        (
            {"schedules": {"full": "every night"}},
            r"schedules\.full: cron 'every night' has 2 fields",
        ),
        ({"thresholds": {"max_bad": 0.1}}, r"accounts\.eu\.thresholds: unknown threshold max_bad"),
        (
            {"thresholds": {"quiet_windows": 2.5}},
            r"thresholds: threshold quiet_windows must be a whole number",
        ),
        ({"thresholds": {"max_bad_ratio": 3}}, r"accounts\.eu\.thresholds: .*max_bad_ratio"),
        ({"rate_budget": "One Key"}, r"accounts\.eu\.rate_budget: .*should match pattern"),
    ],
)
def test_a_bad_account_field_is_named(change: dict[str, Any], message: str):
    with pytest.raises(ConfigError, match=message):
        parse_accounts(_file(**change), source="suppliers.yaml")


def test_a_supplier_may_bound_its_clients_requests():
    data = _file()
    data["suppliers"]["acme"].update(
        request_deadline=20, max_body_bytes=2**20, max_decoded_bytes=4 * 2**20
    )
    eu, us, main = parse_accounts(data)
    assert (eu.request_deadline, eu.max_body_bytes, eu.max_decoded_bytes) == (
        20.0,
        2**20,
        4 * 2**20,
    )
    assert us.request_deadline == 20.0  # the supplier's, for every account of it
    assert (main.request_deadline, main.max_body_bytes) == (None, None)  # the settings'
    for field, value, why in [
        ("request_deadline", 0, "greater than 0"),
        ("request_deadline", "60s", "valid number"),
        ("max_body_bytes", 10, "greater than or equal to 1024"),
    ]:
        bad = _file()
        bad["suppliers"]["acme"][field] = value
        with pytest.raises(ConfigError, match=rf"suppliers\.acme\.{field}: .*{why}"):
            parse_accounts(bad)


def test_bad_suppliers_are_named():
    data = _file()
    data["suppliers"]["globex"]["supplier_id"] = 1001
    with pytest.raises(ConfigError, match="'acme' and 'globex' share supplier_id 1001"):
        parse_accounts(data)
    data = _file()
    data["suppliers"]["Acme-Corp"] = data["suppliers"].pop("acme")
    with pytest.raises(ConfigError, match="supplier 'Acme-Corp' is not a slug"):
        parse_accounts(data)
    data = _file()
    data["suppliers"]["acme"]["accounts"] = {}
    with pytest.raises(ConfigError, match=r"suppliers\.acme\.accounts: .*at least 1 item"):
        parse_accounts(data)
    data = _file()
    data["suppliers"]["acme"]["base_url"] = "ftp://x"
    with pytest.raises(ConfigError, match=r"suppliers\.acme\.base_url: 'ftp://x' is not an http"):
        parse_accounts(data)
    with pytest.raises(ConfigError, match=r"suppliers: Field required"):
        parse_accounts({"supplier": {}})


def test_the_file_is_read_when_asked(tmp_path: Path):
    path = tmp_path / "suppliers.yaml"
    with pytest.raises(ConfigError, match="cannot read the suppliers file"):
        load_accounts(path)
    path.write_text("suppliers: [unclosed\n")
    with pytest.raises(ConfigError, match=f"{path}: not YAML"):
        load_accounts(path)
    path.write_text(
        "suppliers:\n  acme:\n    supplier_id: 1001\n    accounts:\n      eu: {rate_limit_rps: -1}\n"
    )
    with pytest.raises(
        ConfigError, match=rf"{path}: suppliers\.acme\.accounts\.eu\.rate_limit_rps"
    ):
        load_accounts(path)
    path.write_text("suppliers:\n  acme:\n    supplier_id: 1001\n    accounts:\n      eu: {}\n")
    (account,) = load_accounts(path)
    assert account.code == "acme.eu" and account.base_url is None


def test_the_example_file_in_deploy_is_valid():
    root = Path(__file__).resolve().parents[2]
    accounts = load_accounts(root / "deploy" / "suppliers.example.yaml")
    assert [a.code for a in accounts] == ["acme.eu", "acme.us", "globex.main", "globex.asia"]
    assert accounts[1].schedules.incremental is None
    assert accounts[3].simulator_profile == "hostile" and accounts[3].base_url is None


def test_accounts_on_one_supplier_key_name_one_budget():
    accounts = parse_accounts(_file(rate_budget="acme-key"))
    eu, us, _ = accounts
    assert (eu.rate_budget, us.rate_budget) == ("acme-key", None)
