"""Attack: one hostile report with an extreme payload ruins an estimate.

``laplace`` accepted any grid index up to 2^52: after 300 honest reports of a metric on
[0, 100] the mean was 39.6, and one report of 2^52 made it 8.8e11. Defence: every
mechanism accepts only payloads an honest device can send. For ``laplace`` that is the
grid 0..K widened by the noise tail bound B, the smallest B with
P(|Z| > B) = 2 e^(-g (B + 1)) / (1 + e^-g) < 2^-60 (``noise_tail_bound``): an honest
report is refused with probability below 2^-60, and a hostile one moves a mean of n
reports by at most (K + B) w / n. The other mechanisms' fields were already bounded
(GRR 0..d-1, HR 0..K-1, OLH a in 1..P-1, b in 0..P-1, bucket 0..g-1, unary and RAPPOR
bit vectors of exactly ceil(bits / 8) bytes with zero padding, RAPPOR cohort
0..m-1, Duchi sign -1 or +1); the unit tests here pin every edge. Each refusal names
the report and the allowed range, and through the service a batch holding one such
report is refused whole (422) and changes nothing.
"""

from __future__ import annotations

import base64
import math
import re
import uuid
from collections.abc import Callable
from decimal import Context, Decimal, localcontext
from typing import Any

import httpx
import numpy as np
import pytest

from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec
from simulations.server import Server


def build(**fields: Any) -> Any:
    return make_mechanism(MechanismSpec.model_validate(fields))


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


# --- laplace: the noise tail bound ---------------------------------------------------------


def tail_mass(bound: int, s: int, t: int) -> Decimal:
    """P(|Z| > B) = 2 e^(-g (B + 1)) / (1 + e^-g) for P(Z = z) ∝ e^(-g |z|), g = s / t, in
    50-digit decimals (the sum of the two geometric tails beyond B)."""
    with localcontext(Context(prec=50)):
        g = Decimal(s) / Decimal(t)
        return 2 * (-g * (bound + 1)).exp() / (1 + (-g).exp())


LAPLACE_CASES = [(eps, k) for eps in (0.001, 0.5, 1.0, 2.3, 20.0) for k in (1, 4, 1024, 65536)]


@pytest.mark.parametrize(("epsilon", "grid_steps"), LAPLACE_CASES)
def test_laplace_bound_is_the_smallest_with_honest_tail_below_2_to_minus_60(
    epsilon: float, grid_steps: int
) -> None:
    mech = build(mechanism="laplace", epsilon=epsilon, lower=0.0, upper=1.0, grid_steps=grid_steps)
    bound, s, t = mech.tail_bound, mech.noise_s, mech.noise_t
    limit = Decimal(2) ** -60
    assert tail_mass(bound, s, t) < limit
    assert bound == 0 or tail_mass(bound - 1, s, t) >= limit
    edges = np.array([-bound, grid_steps + bound])
    np.testing.assert_array_equal(mech.from_payloads([{"value": int(v)} for v in edges]), edges)
    for outside in (-bound - 1, grid_steps + bound + 1, 2**52, -(2**62)):
        message = re.escape(f"outside {-bound}..{grid_steps + bound}")
        with pytest.raises(ValueError, match=rf"report 1: grid index {outside} is {message}"):
            mech.from_payloads([{"value": 0}, {"value": outside}])


def test_laplace_bound_matches_the_noise_it_bounds() -> None:
    """Sampled noise: 10^6 draws at eps = 1, K = 4 never leave -B..K+B, while the bound
    is not vacuous: B < 61 ln 2 / g, about 42.3 noise scales 1 / g."""
    mech = build(mechanism="laplace", epsilon=1.0, lower=0.0, upper=1.0, grid_steps=4)
    reports = mech.encode(np.full(1_000_000, 0.5), rng=np.random.default_rng(5))
    assert reports.min() >= -mech.tail_bound and reports.max() <= 4 + mech.tail_bound
    g = mech.noise_s / mech.noise_t
    assert mech.tail_bound < 61 * math.log(2) / g


# --- every mechanism: the edges of its payload ranges ------------------------------------

SPECS: dict[str, dict[str, Any]] = {
    "grr": {"mechanism": "grr", "epsilon": 1.0, "domain_size": 5},
    "hr": {"mechanism": "hr", "epsilon": 1.0, "domain_size": 6},  # K = 8 outputs
    "olh": {"mechanism": "olh", "epsilon": 1.0, "domain_size": 10},  # P = 11, g = 4
    # levels 1 (4 nodes, GRR) and 2 (16 nodes, OLH: P = 17, g = 4)
    "hh": {"mechanism": "hh", "epsilon": 1.0, "lower": 0, "upper": 1, "buckets": 16},
    "sw": {"mechanism": "sw", "epsilon": 1.0, "lower": 0, "upper": 1, "buckets": 16},
    # levels 1 and 2 lgrr, level 3 losue over 27 nodes (4 bytes, 5 padding bits)
    "lhh": {
        "mechanism": "lhh",
        "epsilon": 2.0,
        "epsilon_report": 1.0,
        "lower": 0,
        "upper": 1,
        "buckets": 27,
        "branching": 3,
    },
    "oue": {"mechanism": "oue", "epsilon": 1.0, "domain_size": 10},  # 2 bytes, 6 padding bits
    "sue": {"mechanism": "sue", "epsilon": 1.0, "domain_size": 16},  # 2 bytes, no padding
    "duchi": {"mechanism": "duchi", "epsilon": 1.0, "lower": 0.0, "upper": 1.0},
    "lgrr": {"mechanism": "lgrr", "epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 5},
    # The unary chains: 2 bytes, 6 padding bits.
    "lsue": {"mechanism": "lsue", "epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 10},
    "loue": {"mechanism": "loue", "epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 10},
    "losue": {"mechanism": "losue", "epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 10},
    # Two distinct sorted buckets of 0..9, two bits (one byte, 6 padding bits).
    "dbitflip": {"mechanism": "dbitflip", "epsilon": 1.0, "domain_size": 10, "bits_per_device": 2},
    "onebitmean": {"mechanism": "onebitmean", "epsilon": 1.0, "lower": 0.0, "upper": 1.0},
    # Open-domain strings: a 4 x 10 sketch (2 bytes of bits, 6 padding), a 4 x 8 Hadamard
    # sketch, pem over 2 bytes (2 groups; seeds and buckets from epsilon), sfp over 4 bytes
    # (2 fragment positions) with a 2 x 8 sketch.
    "cms": {"mechanism": "cms", "epsilon": 1.0, "sketch_width": 10, "sketch_depth": 4},
    "hcms": {"mechanism": "hcms", "epsilon": 1.0, "sketch_width": 8, "sketch_depth": 4},
    "pem": {"mechanism": "pem", "epsilon": 1.0, "max_length": 2},
    "sfp": {
        "mechanism": "sfp",
        "epsilon": 1.0,
        "max_length": 4,
        "sketch_width": 8,
        "sketch_depth": 2,
    },
    "rappor": {
        "mechanism": "rappor",
        "num_bits": 12,  # 2 bytes, the 4 high bits of byte 1 are padding (little-endian)
        "num_hashes": 2,
        "num_cohorts": 4,
        "f": 0.5,
        "p": 0.25,
        "q": 0.75,
    },
}

#: (mechanism, payloads an honest device can send at the edges, refused payloads each with
#: a pattern its error must match: the report index 0 and the allowed range or size).
RANGE_CASES: list[tuple[str, list[dict[str, Any]], list[tuple[dict[str, Any], str]]]] = [
    (
        "grr",
        [{"value": 0}, {"value": 4}],
        [({"value": 5}, r"position 0 .*0\.\.4"), ({"value": -1}, r"position 0 .*0\.\.4")],
    ),
    (
        "hr",
        [{"value": 0}, {"value": 7}],
        [({"value": 8}, r"position 0 .*0\.\.7"), ({"value": -1}, r"position 0 .*0\.\.7")],
    ),
    (
        "olh",
        [{"a": 1, "b": 0, "value": 0}, {"a": 10, "b": 10, "value": 3}],
        [
            ({"a": 0, "b": 0, "value": 0}, r"report 0: a = 0 is outside 1\.\.10"),
            ({"a": 11, "b": 0, "value": 0}, r"report 0: a = 11 is outside 1\.\.10"),
            ({"a": 1, "b": 11, "value": 0}, r"report 0: b = 11 is outside 0\.\.10"),
            ({"a": 1, "b": -1, "value": 0}, r"report 0: b = -1 is outside 0\.\.10"),
            ({"a": 1, "b": 0, "value": 4}, r"report 0: value = 4 is outside 0\.\.3"),
        ],
    ),
    (
        "hh",
        [
            {"level": 1, "a": 0, "b": 0, "value": 0},
            {"level": 1, "a": 0, "b": 0, "value": 3},
            {"level": 2, "a": 16, "b": 16, "value": 3},
        ],
        [
            ({"level": 0, "a": 0, "b": 0, "value": 0}, r"report 0: level = 0 is outside 1\.\.2"),
            ({"level": 3, "a": 0, "b": 0, "value": 0}, r"report 0: level = 3 is outside 1\.\.2"),
            ({"level": 1, "a": 1, "b": 0, "value": 0}, r"report 0: a = 1 is outside 0\.\.0"),
            ({"level": 1, "a": 0, "b": 0, "value": 4}, r"report 0: value = 4 is outside 0\.\.3"),
            ({"level": 2, "a": 0, "b": 0, "value": 0}, r"report 0: a = 0 is outside 1\.\.16"),
            ({"level": 2, "a": 1, "b": 17, "value": 0}, r"report 0: b = 17 is outside 0\.\.16"),
        ],
    ),
    (
        "lhh",
        [
            {"level": 1, "value": 0, "bits": ""},
            {"level": 2, "value": 8, "bits": ""},
            {"level": 3, "value": 0, "bits": b64(b"\xff\xff\xff\xe0")},
        ],
        [
            ({"level": 0, "value": 0, "bits": ""}, r"report 0: level = 0 is outside 1\.\.3"),
            ({"level": 4, "value": 0, "bits": ""}, r"report 0: level = 4 is outside 1\.\.3"),
            ({"level": 1, "value": 3, "bits": ""}, r"report 0: value = 3 is outside 0\.\.2"),
            ({"level": 2, "value": -1, "bits": ""}, r"report 0: value = -1 is outside 0\.\.8"),
            (
                {"level": 1, "value": 0, "bits": b64(b"\x00")},
                r"report 0: 'bits' holds 1 bytes, expected 0",
            ),
            (
                {"level": 3, "value": 1, "bits": b64(bytes(4))},
                r"report 0: value = 1 is outside 0\.\.0",
            ),
            (
                {"level": 3, "value": 0, "bits": b64(b"\xff\xff\xff\xf0")},
                r"report 0: sets bits past bit 26",
            ),
            (
                {"level": 3, "value": 0, "bits": b64(bytes(3))},
                r"report 0: 'bits' holds 3 bytes, expected 4",
            ),
        ],
    ),
    (
        "sw",
        [{"value": 0}, {"value": 22}],
        [
            ({"value": 23}, r"report 0: cell index 23 is outside 0\.\.22"),
            ({"value": -1}, r"report 0: cell index -1 is outside 0\.\.22"),
        ],
    ),
    (
        "oue",
        [{"bits": b64(b"\x00\x00")}, {"bits": b64(b"\xff\xc0")}],
        [
            ({"bits": b64(b"\xff\xe0")}, r"0 sets padding bits past bit 9"),
            ({"bits": b64(b"\x00")}, r"report 0: 'bits' holds 1 bytes, expected 2"),
            ({"bits": b64(b"\x00\x00\x00")}, r"report 0: 'bits' holds 3 bytes, expected 2"),
        ],
    ),
    (
        "sue",
        [{"bits": b64(b"\xff\xff")}],
        [({"bits": b64(b"\xff")}, r"report 0: 'bits' holds 1 bytes, expected 2")],
    ),
    (
        "lgrr",
        [{"value": 0}, {"value": 4}],
        [({"value": 5}, r"position 0 .*0\.\.4"), ({"value": -1}, r"position 0 .*0\.\.4")],
    ),
    *(
        (
            name,
            [{"bits": b64(b"\x00\x00")}, {"bits": b64(b"\xff\xc0")}],
            [
                ({"bits": b64(b"\xff\xe0")}, r"0 sets padding bits past bit 9"),
                ({"bits": b64(b"\x00")}, r"report 0: 'bits' holds 1 bytes, expected 2"),
            ],
        )
        for name in ("lsue", "loue", "losue")
    ),
    (
        "dbitflip",
        [
            {"buckets": b64(np.array([0, 1], "<u4").tobytes()), "bits": b64(b"\x00")},
            {"buckets": b64(np.array([8, 9], "<u4").tobytes()), "bits": b64(b"\xc0")},
        ],
        [
            (
                {"buckets": b64(np.array([0, 10], "<u4").tobytes()), "bits": b64(b"\x00")},
                r"report 0: bucket 10 is outside 0\.\.9",
            ),
            (
                {"buckets": b64(np.array([3, 3], "<u4").tobytes()), "bits": b64(b"\x00")},
                r"report 0: buckets \[3, 3\] are not strictly increasing",
            ),
            (
                {"buckets": b64(np.array([1, 3], "<u4").tobytes()), "bits": b64(b"\xe0")},
                r"report 0 sets padding bits past bit 1",
            ),
        ],
    ),
    (
        "onebitmean",
        [{"value": 0}, {"value": 1}],
        [({"value": 2}, r"report 0: the bit must be 0 or 1"), ({"value": -1}, r"0 or 1")],
    ),
    (
        "cms",
        [{"row": 0, "bits": b64(b"\x00\x00")}, {"row": 3, "bits": b64(b"\xff\xc0")}],
        [
            ({"row": 4, "bits": b64(b"\x00\x00")}, r"row 4 at position 0 .*0\.\.3"),
            ({"row": -1, "bits": b64(b"\x00\x00")}, r"row -1 at position 0 .*0\.\.3"),
            ({"row": 0, "bits": b64(b"\xff\xe0")}, r"report 0 sets padding bits past bit 9"),
            ({"row": 0, "bits": b64(b"\x00")}, r"report 0: 'bits' holds 1 bytes, expected 2"),
        ],
    ),
    (
        "hcms",
        [{"row": 0, "column": 0, "bit": 0}, {"row": 3, "column": 7, "bit": 1}],
        [
            ({"row": 4, "column": 0, "bit": 0}, r"row 4 at position 0 .*0\.\.3"),
            ({"row": 0, "column": 8, "bit": 0}, r"column 8 at position 0 .*0\.\.7"),
            ({"row": 0, "column": 0, "bit": 2}, r"bit 2 at position 0 .*0\.\.1"),
        ],
    ),
    (
        "pem",
        [{"group": 0, "seed": 0, "value": 0}, {"group": 1, "seed": 8191, "value": 3}],
        [
            ({"group": 2, "seed": 0, "value": 0}, r"report 0: group = 2 is outside 0\.\.1"),
            ({"group": 0, "seed": 8192, "value": 0}, r"seed = 8192 is outside 0\.\.8191"),
            ({"group": 0, "seed": 0, "value": 4}, r"report 0: value = 4 is outside 0\.\.3"),
        ],
    ),
    (
        "sfp",
        [
            {"kind": 0, "position": 0, "row": 0, "bits": b64(b"\x00")},
            {"kind": 1, "position": 1, "row": 1, "bits": b64(b"\xff")},
        ],
        [
            (
                {"kind": 2, "position": 0, "row": 0, "bits": b64(b"\x00")},
                r"kind 2 at position 0 .*0\.\.1",
            ),
            (
                {"kind": 1, "position": 2, "row": 0, "bits": b64(b"\x00")},
                r"report 0: position 2 is invalid for kind 1",
            ),
            (
                {"kind": 0, "position": 0, "row": 2, "bits": b64(b"\x00")},
                r"row 2 at position 0 .*0\.\.1",
            ),
            (
                {"kind": 0, "position": 0, "row": 0, "bits": b64(b"\x00\x00")},
                r"report 0: 'bits' holds 2 bytes, expected 1",
            ),
        ],
    ),
    (
        "duchi",
        [{"value": -1}, {"value": 1}],
        [({"value": 0}, r"report 0: sign must be -1 or \+1"), ({"value": 2}, r"-1 or \+1")],
    ),
    (
        "rappor",
        [{"cohort": 0, "bits": b64(b"\x00\x00")}, {"cohort": 3, "bits": b64(b"\xff\x0f")}],
        [
            ({"cohort": 4, "bits": b64(b"\x00\x00")}, r"report 0: cohort 4 is outside 0\.\.3"),
            ({"cohort": -1, "bits": b64(b"\x00\x00")}, r"report 0: cohort -1 is outside 0\.\.3"),
            ({"cohort": 0, "bits": b64(b"\x00\x10")}, r"report 0: .*padding bits past bit 11"),
            ({"cohort": 0, "bits": b64(b"\x00")}, r"report 0: 'bits' holds 1 bytes, expected 2"),
        ],
    ),
]


@pytest.mark.parametrize(("name", "edges", "refused"), RANGE_CASES, ids=[c[0] for c in RANGE_CASES])
def test_payloads_outside_each_range_are_refused_naming_it(
    name: str, edges: list[dict[str, Any]], refused: list[tuple[dict[str, Any], str]]
) -> None:
    mech = build(**SPECS[name])
    assert len(mech.from_payloads(edges)) == len(edges)
    for payload, pattern in refused:
        with pytest.raises(ValueError, match=pattern):
            mech.from_payloads([payload])


def test_every_mechanism_with_payloads_is_covered() -> None:
    """Guards the table above: each registered mechanism is here, or pinned elsewhere
    (laplace above, piecewise by its own tests, spl/smp/rsfd in test_multidim.py and
    test_properties.py's out-of-range payloads)."""
    from shared.mechanisms import MECHANISMS

    pinned = {"laplace", "piecewise", "spl", "smp", "rsfd"}
    assert set(MECHANISMS) - {name for name, _, _ in RANGE_CASES} == pinned


# --- through the service: one hostile report cannot move the published mean ----------------

LAPLACE_METRIC = {"mechanism": "laplace", "epsilon": 1.0, "lower": 0.0, "upper": 100.0}


def post(server: Server, payloads: list[dict[str, Any]]) -> httpx.Response:
    reports = [
        {"report_id": str(uuid.uuid4()), "metric": "minutes", "version": 1, "payload": payload}
        for payload in payloads
    ]
    return httpx.post(
        f"{server.url}/v1/reports",
        json={"reports": reports},
        headers=server.headers("device"),
        timeout=60,
    )


def published(server: Server) -> dict[str, Any]:
    response = httpx.get(
        f"{server.url}/v1/metrics/minutes/estimate",
        headers=server.headers("analyst"),
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


@pytest.mark.slow
def test_a_huge_laplace_index_is_refused_and_changes_nothing(
    hostile_target: Callable[..., Server],
) -> None:
    server = hostile_target()
    response = httpx.put(
        f"{server.url}/v1/metrics/minutes",
        json={"mechanism": LAPLACE_METRIC},
        headers=server.headers("admin"),
        timeout=30,
    )
    assert response.status_code == 201, response.text
    mech = build(**LAPLACE_METRIC)
    rng = np.random.default_rng(7)  # simulated devices: seeded, so the test is reproducible
    honest = mech.encode(rng.uniform(20.0, 60.0, 300), rng=rng)
    reply = post(server, mech.to_payloads(honest))
    assert reply.json() == {"accepted": 300, "duplicates": 0}, reply.text
    before = published(server)
    assert before["n"] == 300
    # The honest mean: 40 give or take the noise, whose std over 300 reports is
    # w sqrt(2 e^-g) / (1 - e^-g) / sqrt(300) = 8.2 (g = 1 / 1024, w = 100 / 1024).
    assert 0.0 <= before["mean"] <= 100.0

    hostile = [{"value": 3}, {"value": 2**52}, {"value": 5}]
    refused = post(server, hostile)
    assert refused.status_code == 422, refused.text
    problem = refused.json()
    high = mech.grid_steps + mech.tail_bound
    assert f"outside {-mech.tail_bound}..{high}" in refused.text, problem
    assert published(server) == before  # nothing of the batch was stored

    past_rule = post(server, [{"value": mech.grid_steps + mech.refusal_bound + 1}])
    assert past_rule.json()["errors"][0]["rule"] == "laplace.noise_tail", past_rule.text
    accepted = mech.grid_steps + mech.refusal_bound  # the largest index the rule accepts
    edge = post(server, [{"value": accepted}])  # moves the mean boundedly
    assert edge.json() == {"accepted": 1, "duplicates": 0}, edge.text
    after = published(server)
    assert abs(after["mean"] - before["mean"]) <= (accepted * mech.step) / 301 + 1e-9
