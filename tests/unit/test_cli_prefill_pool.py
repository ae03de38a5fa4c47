"""`epd up --prefill-workers N`: the cluster spec and port plan the flags give, and the combinations refused before
anything starts (the cluster it starts is tests/integration/test_pd_cluster.py's, through the same `ClusterSpec`)."""

from __future__ import annotations

import pytest

from services.cli import _parser
from services.cli_errors import USAGE, UserError
from services.cli_up import port_rows, spec_from_args, up
from services.launch.local import ClusterSpec, plan_ports


def test_the_flags_give_a_prefill_pool_after_the_workers() -> None:
    args = _parser().parse_args(["up", "--workers", "2", "--prefill-workers", "2", "--pd-min-prefill-tokens", "300"])
    spec = spec_from_args(args, "cpu")
    assert (spec.workers, spec.prefill_workers, spec.pd_min_prefill_tokens) == (2, 2, 300)
    plan = plan_ports(spec)
    assert plan.workers == (50071, 50072) and plan.prefill == (50073, 50074)
    assert len(plan.metrics) == 1 + 2 + 2 + 1  # encoder, workers, prefill workers, router: one port each
    assert [row[2] for row in port_rows(plan)].count("--worker-port") == 4


def test_without_the_flag_there_is_no_pool() -> None:
    spec = spec_from_args(_parser().parse_args(["up"]), "cpu")
    assert spec.prefill_workers == 0 and spec.pd_min_prefill_tokens == ClusterSpec.pd_min_prefill_tokens
    assert plan_ports(spec).prefill == ()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["up", "--prefill-workers", "1", "--tensor-parallel-size", "2"], "per rank"),
        (["up", "--prefill-workers", "1", "--ray"], "--ray"),
    ],
)
def test_refused_combinations_are_usage_errors(argv: list[str], words: str) -> None:
    args = _parser().parse_args(argv)
    with pytest.raises(UserError) as refused:
        up(args) if args.ray else spec_from_args(args, "cpu")
    assert refused.value.exit_code == USAGE and words in refused.value.message
