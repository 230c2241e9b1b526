"""Benchmark of secure aggregation (SecAgg+): ours against Flower's, side by side.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.secagg_bench --quick   # 20 and 40 devices, a minute
    python -m simulations.benchmarks.secagg_bench           # 100 to 1,000 devices, ~1 hour

Every setting is a round of ``n`` devices (``--clients``), inputs of ``L`` coordinates
(``--lengths``) and a share ``--dropouts`` of the devices dropping out after sharing their
keys, before sending a masked input (the costly case for the server: it rebuilds their
masking keys and removes their pairwise masks from every surviving neighbour); extra
settings at ``n = 300, L = 10^4`` with 0% and 30% dropouts (left out by ``--no-extra``).

Both sides run the same round: the graph degree ``k`` and threshold ``t`` of
``plan_parameters`` (our :class:`SecureAggregationSpec` defaults: planned for up to 30%
dropouts), masks in ``Z_(2^32)``, the same integer inputs ``m`` in ``[0, 2^22)``.

* **Ours** (:mod:`shared.federated.secagg`): every device a :class:`SecAggClient`, the
  server :func:`unmask_request` and :func:`reconstruct_sum`. A device's bytes are its
  JSON wire bodies (:mod:`shared.federated.secagg_messages`): sent ``KeysUpload``,
  ``SharesUpload``, ``UnmaskUpload``; received ``KeysAccepted``, ``RosterOut`` (every
  device's keys), ``SharesInbox``, ``UnmaskRequestOut`` and three ``StepAccepted``; the
  ``MaskedUpload`` apart (the masked vector).
* **Flower** (``flwr``, the version in the header): each device runs the four stage
  functions of its client mod ``flwr.client.mod.secure_aggregation.secaggplus_mod``
  (``_setup``, ``_share_keys``, ``_collect_masked_vectors``, ``_unmask``) on a
  ``SecAggPlusState``, given the ``ConfigRecord`` contents its workflow
  (``flwr.server.workflow.secure_aggregation.secaggplus_workflow``) builds, without the
  message transport and the state's round trip through the context. Its parameters:
  ``num_shares = k + 1`` (its neighbourhoods count the device itself: the ring offsets
  ``-k/2 .. k/2`` of a shuffled order), ``reconstruction_threshold = t``,
  ``modulus_range = 2^32``, ``quantization_range = 2^22``, ``clipping_range = 8``,
  ``max_weight`` equal to the device's weight. Its input is the float vector
  ``x = m 2c / 2^22 - c``, which its stochastic quantizer maps back onto ``m`` exactly,
  so both sides sum the same integers (Flower adds its weight as one more coordinate).
  Its server side is this module's driver of the workflow's steps on Flower's own
  functions, in its order: decode and add the masked vectors (``bytes_to_ndarray``,
  ``parameters_addition``, ``parameters_mod``), then for every device
  ``combine_shares``, and ``pseudo_rand_gen`` of the survivors' seeds, or for the
  dropped ones, of ``generate_shared_key`` with each neighbour, then ``factor_extract``
  and ``dequantize``. A device's bytes are the serialized protobuf sizes of its
  ``ConfigRecord``\\ s (``config_record_to_proto(...).ByteSize()``): received the setup
  record, its neighbours' public keys, the forwarded ciphertexts (not the model it trains
  on) and the unmask request; sent its public keys, its ciphertexts and its revealed
  shares; the masked parameters apart.

The two differ in their primitives, which the costs reflect: Flower's key pairs are
ECDH on P-384 (PEM-encoded; the PEM text of the first private key is what it
Shamir-shares, in 16-byte chunks over GF(2^128) with PyCryptodome, each share carrying
every chunk), its shares travel under Fernet (AES-128-CBC with HMAC-SHA256, base64), and
its masks are numpy's Mersenne Twister seeded with the 32-bit XOR fold of the seed (cheaper
than our AES-256-CTR keystream, and with 32 bits of seed); ours are X25519, HKDF-SHA256,
AES-GCM and Shamir over ``2^521 - 1`` of the 32-byte secrets.

Client CPU is ``time.process_time`` around a device's four steps (its input given),
averaged over the devices timed (every device of ours); server CPU is the summation of the
masked inputs plus the unmasking (ours: ``unmask_request`` of every device and
``reconstruct_sum``). Both totals must equal the sum of the included inputs mod ``2^32``
(checked; a mismatch is a FAIL).

**Sampled Flower rounds.** Flower's Shamir sharing (PyCryptodome, over 16-byte chunks of
a PEM private key) costs seconds per device at ``k`` in the hundreds, so a full round of
1,000 devices takes hours. When the projected CPU of a full round exceeds
``--peer-budget``, only ``--peer-sample`` devices run their four steps (timed as above;
every other device gets its keys, and the ciphertexts a sampled device receives are
encrypted under the true pair keys, holding shares of the sampled device's own size), and
the server's time is **extrapolated**: the measured cost of one masked vector's summation
times the survivors, of one survivor's unmasking times the survivors, of one dropped
device's unmasking (its ``k`` neighbours' masks) times the dropped ones. Such rows are
marked ``extrap.``; their correctness check is that every combined secret equals the
sampled device's own.

Targets (the table's last lines): at 1,000 devices, ``L = 10^5``, 10% dropouts, our
server under 60 s CPU and a device under 2 s and 2 MB besides its masked vector; against
Flower, a device's CPU and bytes no more than Flower's, the server at least 2x faster.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import importlib.metadata
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.federated import secagg
from shared.federated.secagg_messages import (
    EncryptedShareIn,
    EncryptedShareOut,
    KeysAccepted,
    KeysUpload,
    MaskedUpload,
    ParticipantKeys,
    RevealedShare,
    RosterOut,
    SharesInbox,
    SharesUpload,
    StepAccepted,
    UnmaskRequestOut,
    UnmaskUpload,
)
from shared.federated.task import SecureAggregationSpec
from simulations.arguments import list_of, user_count

#: Bits of the ring (Flower's ``modulus_range = 2^32``) and of its quantization range.
MODULUS_BITS = 32
QUANTIZATION_BITS = 22
CLIPPING_RANGE = 8.0
#: A device's weight; Flower's ``max_weight`` is set to it, so its weight ratio is 1.
WEIGHT = 1000.0

#: Flower's client mod of SecAgg+ (its package exports the mod's function by the same name).
FLOWER_MOD = "flwr.client.mod.secure_aggregation.secaggplus_mod"

#: The target row and its bounds.
TARGET_SETTING = (1000, 100_000, 0.1)
SERVER_SECONDS_TARGET = 60.0
CLIENT_SECONDS_TARGET = 2.0
CLIENT_BYTES_TARGET = 2_000_000
SERVER_SPEEDUP_TARGET = 2.0

FULL: dict[str, Any] = {
    "clients": [100, 300, 1000],
    "lengths": [1000, 10_000, 100_000],
    "dropouts": [0.1],
    "extra": [(300, 10_000, 0.0), (300, 10_000, 0.3)],
}
QUICK: dict[str, Any] = {
    "clients": [20, 40],
    "lengths": [100, 1000],
    "dropouts": [0.1],
    "extra": [(40, 1000, 0.0), (40, 1000, 0.3)],
}


@dataclass(frozen=True)
class Setting:
    """One round: ``clients`` devices, inputs of ``length`` coordinates, a share
    ``dropout`` of them dropping out before the masked-input step."""

    clients: int
    length: int
    dropout: float

    @property
    def label(self) -> str:
        return f"n={self.clients} L={self.length:.0e} drop={self.dropout:.0%}".replace("+0", "")


@dataclass
class Measured:
    """One side's costs in one setting (seconds of CPU, bytes)."""

    client_seconds: list[float] = field(default_factory=list)  # per timed device
    client_bytes: list[int] = field(default_factory=list)  # besides the masked vector
    masked_bytes: int = 0
    server_seconds: float = math.nan
    extrapolated: bool = False
    timed: int = 0

    @property
    def client_mean(self) -> float:
        return float(np.mean(self.client_seconds)) if self.client_seconds else math.nan

    @property
    def client_max(self) -> float:
        return float(np.max(self.client_seconds)) if self.client_seconds else math.nan

    @property
    def bytes_mean(self) -> float:
        return float(np.mean(self.client_bytes)) if self.client_bytes else math.nan


def dropped_devices(clients: int, dropout: float, rng: np.random.Generator) -> frozenset[int]:
    """``round(dropout n)`` devices drawn without replacement."""
    count = round(dropout * clients)
    return frozenset(int(i) for i in rng.choice(clients, size=count, replace=False))


def flower_floats(values: np.ndarray) -> np.ndarray:
    """The floats Flower's quantizer maps onto the integers ``values`` in ``[0, 2^22)``:
    ``x = m 2c / 2^22 - c`` (``c = 8``: ``2c / 2^22 = 2^-18``, exact in binary64, so
    ``(x + c) 2^22 / (2c) = m`` exactly and its stochastic rounding leaves it there)."""
    step = 2 * CLIPPING_RANGE / 2**QUANTIZATION_BITS
    return np.asarray(values, dtype=np.float64) * step - CLIPPING_RANGE


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _json_size(model: Any) -> int:
    return len(model.model_dump_json().encode())


# ---------------------------------------------------------------------------------- ours


def run_ours(
    setting: Setting, inputs: np.ndarray, dropped: frozenset[int], spec: SecureAggregationSpec
) -> tuple[Measured, secagg.SecAggParameters]:
    """A full round of our protocol, every device timed; asserts the unmasked sum."""
    n, length = setting.clients, setting.length
    parameters = secagg.plan_parameters(n, length, MODULUS_BITS, spec)
    context = secagg.RoundContext("bench", 0, 0)
    seconds = np.zeros(n)
    sizes = np.zeros(n, dtype=np.int64)

    clients, keys = [], []
    for u in range(n):
        start = time.process_time()
        client = secagg.SecAggClient(context)
        advertised = client.advertise()
        seconds[u] += time.process_time() - start
        clients.append(client)
        keys.append(advertised)
        upload = KeysUpload(
            attempt=0,
            encryption_key=_b64(advertised.encryption_key),
            masking_key=_b64(advertised.masking_key),
        )
        sizes[u] += _json_size(upload) + _json_size(KeysAccepted(participant=u, duplicate=False))
    roster = secagg.Roster(context, parameters, tuple(keys))
    roster_out = RosterOut(
        task=context.task, round=0, attempt=0,
        participants=[
            ParticipantKeys(index=i, encryption_key=_b64(k.encryption_key),
                            masking_key=_b64(k.masking_key))
            for i, k in enumerate(keys)
        ],
        neighbours=parameters.neighbours, threshold=parameters.threshold,
        modulus_bits=MODULUS_BITS, vector_length=length,
    )  # fmt: skip
    accepted = {
        step: _json_size(StepAccepted(step=step, duplicate=False))
        for step in ("shares", "masked", "unmask")
    }
    sizes += _json_size(roster_out)

    inboxes: dict[int, dict[int, bytes]] = {u: {} for u in range(n)}
    for u in range(n):
        start = time.process_time()
        outbox = clients[u].share_keys(roster, u)
        seconds[u] += time.process_time() - start
        shares_upload = SharesUpload(
            shares=[EncryptedShareIn(recipient=v, ciphertext=_b64(c)) for v, c in outbox.items()]
        )
        sizes[u] += _json_size(shares_upload) + accepted["shares"]
        for v, ciphertext in outbox.items():
            inboxes[v][u] = ciphertext
    shared = frozenset(range(n))

    masked_bodies: dict[int, bytes] = {}
    masked_size = 0
    for u in sorted(shared - dropped):
        inbox = inboxes[u]
        sizes[u] += _json_size(
            SharesInbox(
                shares=[EncryptedShareOut(sender=v, ciphertext=_b64(c)) for v, c in inbox.items()]
            )
        )
        start = time.process_time()
        y = clients[u].mask(inbox, inputs[u])
        body = secagg.encode_ring(y, MODULUS_BITS)
        seconds[u] += time.process_time() - start
        masked_bodies[u] = body
        masked_size = _json_size(MaskedUpload(masked=_b64(body)))
        sizes[u] += accepted["masked"]
    masked = frozenset(masked_bodies)

    start = time.process_time()
    total = np.zeros(length, dtype=parameters.dtype)
    for body in masked_bodies.values():
        total += secagg.decode_ring(body, MODULUS_BITS, length)
    requests = {w: secagg.unmask_request(roster, shared, masked, w) for w in sorted(masked)}
    server = time.process_time() - start

    seed_shares: dict[int, dict[int, bytes]] = {}
    key_shares: dict[int, dict[int, bytes]] = {}
    for w, (survivors, gone) in requests.items():
        sizes[w] += _json_size(
            UnmaskRequestOut(survivors=survivors, dropped=gone, masked_inputs=len(masked))
        )
        start = time.process_time()
        seeds, secret_keys = clients[w].unmask(survivors, gone)
        seconds[w] += time.process_time() - start
        unmask_upload = UnmaskUpload(
            mask_seed_shares=[RevealedShare(owner=o, share=_b64(s)) for o, s in seeds.items()],
            secret_key_shares=[
                RevealedShare(owner=o, share=_b64(s)) for o, s in secret_keys.items()
            ],
        )
        sizes[w] += _json_size(unmask_upload) + accepted["unmask"]
        for owner, share in seeds.items():
            seed_shares.setdefault(owner, {})[w] = share
        for owner, share in secret_keys.items():
            key_shares.setdefault(owner, {})[w] = share

    start = time.process_time()
    result = secagg.reconstruct_sum(roster, shared, masked, total, seed_shares, key_shares)
    server += time.process_time() - start

    included = sorted(masked)
    expected = secagg.to_ring(inputs[included].sum(axis=0), MODULUS_BITS)
    if not np.array_equal(result, expected):
        raise AssertionError(f"{setting.label}: our unmasked sum differs from the true sum")
    timed = sorted(masked)  # the devices that ran all four steps
    measured = Measured(
        client_seconds=[float(seconds[u]) for u in timed],
        client_bytes=[int(sizes[u]) for u in timed],
        masked_bytes=masked_size,
        server_seconds=server,
        timed=len(timed),
    )
    return measured, parameters


# -------------------------------------------------------------------------------- Flower


def flower_status() -> str:
    """``"<version>"`` of flwr, or ``"unavailable (<reason>)"``."""
    try:
        importlib.import_module(FLOWER_MOD)
        return importlib.metadata.version("flwr")
    except Exception as error:  # noqa: BLE001 - any failure means "not available"
        return f"unavailable ({type(error).__name__}: {error})"


def flower_neighbours(order: np.ndarray, num_shares: int) -> list[set[int]]:
    """Flower's graph: device ``order[p]`` holds ``order[p + o]`` for ``o`` in
    ``-num_shares // 2 .. num_shares // 2`` (itself included), ``order`` shuffled."""
    n, half = len(order), num_shares >> 1
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    return [{int(order[(position[i] + o) % n]) for o in range(-half, half + 1)} for i in range(n)]


class _Flower:
    """Flower's four client stages on one state per device, and the record sizes."""

    def __init__(self, parameters: secagg.SecAggParameters, n: int, rng: np.random.Generator):
        from flwr.app import ConfigRecord
        from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage
        from flwr.common.serde import config_record_to_proto

        mod = importlib.import_module(FLOWER_MOD)
        self.ConfigRecord, self.mod, self.Key = ConfigRecord, mod, Key
        self._proto = config_record_to_proto
        self.num_shares = parameters.neighbours + 1
        self.threshold = parameters.threshold
        self.length = parameters.vector_length
        ids = rng.choice(2**62, size=n, replace=False) + 1
        self.nids = [int(v) for v in ids]
        self.neighbours = flower_neighbours(rng.permutation(n), self.num_shares)
        self.setup_values: dict[str, Any] = {
            Key.SAMPLE_NUMBER: n,
            Key.SHARE_NUMBER: self.num_shares,
            Key.THRESHOLD: self.threshold,
            Key.CLIPPING_RANGE: CLIPPING_RANGE,
            Key.TARGET_RANGE: 2**QUANTIZATION_BITS,
            Key.MOD_RANGE: 2**MODULUS_BITS,
            Key.MAX_WEIGHT: WEIGHT,
        }
        self.setup_size = self.size({Key.STAGE: Stage.SETUP, **self.setup_values})
        self.stage = Stage
        self.states = [mod.SecAggPlusState() for _ in range(n)]

    def size(self, values: Mapping[str, Any]) -> int:
        record: Any = dict(values)
        return int(self._proto(self.ConfigRecord(record)).ByteSize())

    def setup(self, i: int) -> tuple[float, int]:
        state = self.states[i]
        state.nid = self.nids[i]
        start = time.process_time()
        keys = self.mod._setup(state, self.ConfigRecord(dict(self.setup_values)))
        return time.process_time() - start, self.setup_size + self.size(keys)

    def key_record(self, i: int) -> dict[str, Any]:
        return {
            str(self.nids[j]): [self.states[j].pk1, self.states[j].pk2] for j in self.neighbours[i]
        }

    def share_keys(self, i: int) -> tuple[float, int, dict[str, Any]]:
        record = self.key_record(i)
        start = time.process_time()
        result = self.mod._share_keys(self.states[i], self.ConfigRecord(record))
        seconds = time.process_time() - start
        size = self.size({self.Key.STAGE: self.stage.SHARE_KEYS, **record}) + self.size(result)
        return seconds, size, result

    def collect(
        self, i: int, sources: list[int], ciphertexts: list[bytes], values: np.ndarray
    ) -> tuple[float, int, list[bytes]]:
        from flwr.common import ndarrays_to_parameters

        Key = self.Key
        record: dict[str, Any] = {Key.CIPHERTEXT_LIST: ciphertexts, Key.SOURCE_LIST: sources}
        parameters = ndarrays_to_parameters([flower_floats(values)])
        start = time.process_time()
        result = self.mod._collect_masked_vectors(
            self.states[i], self.ConfigRecord(record), int(WEIGHT), parameters
        )
        seconds = time.process_time() - start
        size = self.size({Key.STAGE: self.stage.COLLECT_MASKED_VECTORS, **record})
        return seconds, size, result[Key.MASKED_PARAMETERS]

    def unmask_request(self, i: int, active: set[int], dead: set[int]) -> dict[str, Any]:
        mine = self.neighbours[i]
        return {
            self.Key.ACTIVE_NODE_ID_LIST: [self.nids[j] for j in mine & active],
            self.Key.DEAD_NODE_ID_LIST: [self.nids[j] for j in mine & dead],
        }

    def unmask(self, i: int, request: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
        start = time.process_time()
        result = self.mod._unmask(self.states[i], self.ConfigRecord(dict(request)))
        seconds = time.process_time() - start
        size = self.size({self.Key.STAGE: self.stage.UNMASK, **request}) + self.size(result)
        return seconds, size, result

    def masked_record_size(self, masked: list[bytes]) -> int:
        return self.size({self.Key.MASKED_PARAMETERS: masked})


def _flower_server_pieces() -> dict[str, Callable[..., Any]]:
    from flwr.common import bytes_to_ndarray
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.common.secure_aggregation.ndarrays_arithmetic import (
        factor_extract,
        get_parameters_shape,
        parameters_addition,
        parameters_mod,
        parameters_subtraction,
    )
    from flwr.common.secure_aggregation.quantization import dequantize
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    return {
        "bytes_to_ndarray": bytes_to_ndarray,
        "combine_shares": combine_shares,
        "generate_shared_key": generate_shared_key,
        "factor_extract": factor_extract,
        "shape": get_parameters_shape,
        "add": parameters_addition,
        "mod": parameters_mod,
        "sub": parameters_subtraction,
        "dequantize": dequantize,
        "prg": pseudo_rand_gen,
        "private": bytes_to_private_key,
        "public": bytes_to_public_key,
    }


def _flower_unmask_one(
    f: dict[str, Callable[..., Any]],
    vector: list[np.ndarray],
    shares: list[bytes],
    alive: bool,
    neighbour_ids: list[int],
    public_keys: Mapping[int, bytes],
    owner_id: int,
) -> tuple[list[np.ndarray], bytes]:
    """The workflow's unmasking of one device: combine its shares; remove its self mask
    (``alive``) or, rebuilt its first private key, the pairwise masks with each neighbour."""
    secret = f["combine_shares"](shares)
    shape = f["shape"](vector)
    if alive:
        return f["sub"](vector, f["prg"](secret, 2**MODULUS_BITS, shape)), secret
    for neighbour in neighbour_ids:
        key = f["generate_shared_key"](f["private"](secret), f["public"](public_keys[neighbour]))
        mask = f["prg"](key, 2**MODULUS_BITS, shape)
        vector = f["add"](vector, mask) if owner_id > neighbour else f["sub"](vector, mask)
    return vector, secret


def run_flower(
    setting: Setting, inputs: np.ndarray, dropped: frozenset[int],
    parameters: secagg.SecAggParameters, rng: np.random.Generator, budget: float, sample: int,
) -> Measured:  # fmt: skip
    """A Flower round (see the module doc): full when its projected CPU is within
    ``budget`` seconds, else ``sample`` devices timed and the server extrapolated."""
    n = setting.clients
    flower = _Flower(parameters, n, rng)
    f = _flower_server_pieces()
    seconds = np.zeros(n)
    sizes = np.zeros(n, dtype=np.int64)
    for i in range(n):
        seconds[i], sizes[i] = flower.setup(i)
    alive_all = set(range(n)) - dropped
    order = [int(i) for i in rng.permutation(sorted(alive_all))]
    share_results: dict[int, dict[str, Any]] = {}
    for i in order[: min(sample, len(order))]:
        spent, size, share_results[i] = flower.share_keys(i)
        seconds[i] += spent
        sizes[i] += size
    first = [seconds[i] for i in share_results]
    projected = 2.5 * n * float(np.mean(first))  # sharing + combining, every device
    full = projected <= budget
    if full:
        for i in range(n):
            if i not in share_results:
                spent, size, share_results[i] = flower.share_keys(i)
                seconds[i] += spent
                sizes[i] += size
    timed = order if full else list(share_results)

    inboxes: dict[int, tuple[list[int], list[bytes]]] = {i: ([], []) for i in timed}
    if full:
        position = {nid: i for i, nid in enumerate(flower.nids)}
        for src, result in share_results.items():
            for dst, ciphertext in zip(
                result[flower.Key.DESTINATION_LIST], result[flower.Key.CIPHERTEXT_LIST],
                strict=True,
            ):  # fmt: skip
                target = position[dst]
                if target in inboxes:
                    inboxes[target][0].append(flower.nids[src])
                    inboxes[target][1].append(ciphertext)
    else:
        for i in timed:
            inboxes[i] = _sampled_inbox(flower, i)

    masked_vectors: dict[int, list[bytes]] = {}
    for i in timed:
        spent, size, masked_vectors[i] = flower.collect(i, *inboxes[i], inputs[i])
        seconds[i] += spent
        sizes[i] += size
    masked_size = flower.masked_record_size(next(iter(masked_vectors.values())))

    active = set(masked_vectors) if full else alive_all
    requests = {i: flower.unmask_request(i, active, set(dropped)) for i in timed}
    revealed: dict[int, dict[str, Any]] = {}
    for i in timed:
        spent, size, revealed[i] = flower.unmask(i, requests[i])
        seconds[i] += spent
        sizes[i] += size

    measured = Measured(
        client_seconds=[float(seconds[i]) for i in timed],
        client_bytes=[int(sizes[i]) for i in timed],
        masked_bytes=masked_size,
        timed=len(timed),
        extrapolated=not full,
    )
    if full:
        measured.server_seconds = _flower_server_full(
            flower, f, setting, inputs, masked_vectors, revealed, dropped
        )
    else:
        measured.server_seconds = _flower_server_sampled(
            flower, f, masked_vectors, share_results, alive_all, len(dropped)
        )
    return measured


def _sampled_inbox(flower: _Flower, i: int) -> tuple[list[int], list[bytes]]:
    """The ciphertexts device ``i`` receives in a sampled round: from each neighbour,
    encrypted under their true pair key (the neighbour's second key pair with ``i``'s)
    and addressed from it to ``i``, holding shares of ``i``'s own shares' sizes (the
    neighbour did not run its costly sharing; decrypting costs the same)."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
        encrypt,
        generate_shared_key,
    )
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    state = flower.states[i]
    seed_share, key_share = state.rd_seed_share_dict[state.nid], state.sk1_share_dict[state.nid]
    sources, ciphertexts = [], []
    for j in sorted(flower.neighbours[i] - {i}):
        other = flower.states[j]
        key = generate_shared_key(bytes_to_private_key(other.sk2), bytes_to_public_key(state.pk2))
        plaintext = share_keys_plaintext_concat(other.nid, state.nid, seed_share, key_share)
        sources.append(other.nid)
        ciphertexts.append(encrypt(key, plaintext))
    return sources, ciphertexts


def _flower_server_full(
    flower: _Flower, f: dict[str, Callable[..., Any]], setting: Setting, inputs: np.ndarray,
    masked_vectors: Mapping[int, list[bytes]], revealed: Mapping[int, dict[str, Any]],
    dropped: frozenset[int],
) -> float:  # fmt: skip
    """The workflow's summation and unmask stage over every device; asserts the sum."""
    Key = flower.Key
    start = time.process_time()
    vector: list[np.ndarray] | None = None
    for masked in masked_vectors.values():
        arrays = [f["bytes_to_ndarray"](b) for b in masked]
        vector = arrays if vector is None else f["add"](vector, arrays)
    assert vector is not None
    vector = f["mod"](vector, 2**MODULUS_BITS)
    collected: dict[int, list[bytes]] = {nid: [] for nid in flower.nids}
    for result in revealed.values():
        for owner, share in zip(result[Key.NODE_ID_LIST], result[Key.SHARE_LIST], strict=True):
            collected[owner].append(share)
    position = {nid: i for i, nid in enumerate(flower.nids)}
    public_keys = {nid: flower.states[position[nid]].pk1 for nid in flower.nids}
    for nid, shares in collected.items():
        if len(shares) < flower.threshold:
            raise AssertionError(f"Flower: device {nid} has {len(shares)} shares")
        i = position[nid]
        neighbour_ids = [flower.nids[j] for j in flower.neighbours[i] - {i}]
        vector, _ = _flower_unmask_one(
            f, vector, shares, i not in dropped, neighbour_ids, public_keys, nid
        )
    vector = f["mod"](vector, 2**MODULUS_BITS)
    weight, summed = f["factor_extract"](vector)
    f["dequantize"](summed, CLIPPING_RANGE, 2**QUANTIZATION_BITS)
    seconds = time.process_time() - start
    included = sorted(masked_vectors)
    expected = inputs[included].sum(axis=0) % 2**MODULUS_BITS
    if not np.array_equal(summed[0], expected):
        raise AssertionError(f"{setting.label}: Flower's unmasked sum differs from the true sum")
    if int(weight) != len(included) * 2**QUANTIZATION_BITS % 2**MODULUS_BITS:
        raise AssertionError(f"{setting.label}: Flower's unmasked weight is wrong")
    return seconds


def _flower_server_sampled(
    flower: _Flower, f: dict[str, Callable[..., Any]], masked_vectors: Mapping[int, list[bytes]],
    share_results: Mapping[int, dict[str, Any]], alive: set[int], dropped: int,
) -> float:  # fmt: skip
    """Extrapolated server CPU: the mean measured cost of adding one masked vector, of
    unmasking one survivor and one dropped device (its ``k`` neighbours), on the sampled
    devices' real vectors and real shares (decrypted from their ciphertexts), times how
    many of each the round has. As in the workflow, a secret is combined from every share
    collected (one per neighbour in ``alive``), not from ``t`` of them: PyCryptodome's
    interpolation costs grow with the square of that count. Checks every combined secret."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

    Key = flower.Key
    vectors = list(masked_vectors.values())
    base = [f["bytes_to_ndarray"](b) for b in vectors[0]]
    start = time.process_time()
    for masked in vectors:
        base = f["add"](base, [f["bytes_to_ndarray"](b) for b in masked])
    add_cost = (time.process_time() - start) / len(vectors)
    position = {nid: i for i, nid in enumerate(flower.nids)}
    public_keys = {nid: state.pk1 for nid, state in zip(flower.nids, flower.states, strict=True)}
    alive_costs, dropped_costs = [], []
    for i, result in share_results.items():
        state = flower.states[i]
        seed_shares, key_shares = (
            [state.rd_seed_share_dict[state.nid]],
            [state.sk1_share_dict[state.nid]],
        )
        for dst, ciphertext in zip(
            result[Key.DESTINATION_LIST], result[Key.CIPHERTEXT_LIST], strict=True
        ):
            plain = decrypt(state.ss2_dict[dst], ciphertext)
            _, _, seed_share, key_share = share_keys_plaintext_separate(plain)
            seed_shares.append(seed_share)
            key_shares.append(key_share)
        # The workflow combines every share it collected: one from each neighbour that
        # answered the unmask request (for a survivor, itself included).
        held = len(flower.neighbours[i] & alive)
        held_by_others = len((flower.neighbours[i] - {i}) & alive)
        neighbour_ids = [flower.nids[j] for j in flower.neighbours[i] - {i}]
        start = time.process_time()
        _, seed = _flower_unmask_one(f, base, seed_shares[:held], True, [], public_keys, 0)
        alive_costs.append(time.process_time() - start)
        start = time.process_time()
        _, key = _flower_unmask_one(
            f, base, key_shares[:held_by_others], False, neighbour_ids, public_keys, state.nid
        )
        dropped_costs.append(time.process_time() - start)
        if seed != state.rd_seed or key != state.sk1 or position[state.nid] != i:
            raise AssertionError("Flower: a combined secret differs from the device's own")
    survivors = len(alive)
    return survivors * (add_cost + float(np.mean(alive_costs))) + dropped * float(
        np.mean(dropped_costs)
    )


# ------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Row:
    setting: Setting
    neighbours: int
    threshold: int
    ours: Measured
    flower: Measured | None


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3g}" if b > 0 and math.isfinite(a) and math.isfinite(b) else "-"


def _si(value: float, unit: str = "") -> str:
    if not math.isfinite(value):
        return "-"
    for scale, prefix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}".rstrip()
    return f"{value:.3g} {unit}".rstrip()


def table_lines(rows: Sequence[Row]) -> list[str]:
    """The markdown table: per setting, each side's client CPU (mean over the timed
    devices), bytes besides the masked vector, masked vector bytes, server CPU, and the
    ratios Flower / ours."""
    lines = [
        "| setting | k | t | client s ours | client s flwr | x | client B ours | client B flwr "
        "| x | masked B ours | masked B flwr | server s ours | server s flwr | x | flwr mode |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        o, p = row.ours, row.flower
        pc, pb, pm, ps = (
            (p.client_mean, p.bytes_mean, p.masked_bytes, p.server_seconds)
            if p is not None
            else (math.nan,) * 4
        )
        mode = "-" if p is None else (
            f"extrap. ({p.timed} timed)" if p.extrapolated else f"full ({p.timed} timed)"
        )  # fmt: skip
        lines.append(
            f"| {row.setting.label} | {row.neighbours} | {row.threshold} "
            f"| {o.client_mean:.3g} | {pc:.3g} | {_ratio(pc, o.client_mean)} "
            f"| {_si(o.bytes_mean, 'B')} | {_si(pb, 'B')} | {_ratio(pb, o.bytes_mean)} "
            f"| {_si(o.masked_bytes, 'B')} | {_si(pm, 'B')} "
            f"| {o.server_seconds:.3g} | {ps:.3g} | {_ratio(ps, o.server_seconds)} | {mode} |"
        )
    return lines


def target_lines(rows: Sequence[Row]) -> list[str]:
    """PASS/FAIL of each target at the target setting (or the largest one run)."""
    if not rows:
        return []
    wanted = Setting(*TARGET_SETTING)
    chosen = next((r for r in rows if r.setting == wanted), None)
    note = ""
    if chosen is None:
        chosen = max(rows, key=lambda r: (r.setting.clients, r.setting.length))
        note = f" (the target setting {wanted.label} was not run; at {chosen.setting.label})"
    o, p = chosen.ours, chosen.flower

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    lines = [f"targets{note}:"]
    lines.append(
        f"  server CPU {o.server_seconds:.3g} s < {SERVER_SECONDS_TARGET:g} s: "
        f"{verdict(o.server_seconds < SERVER_SECONDS_TARGET)}"
    )
    lines.append(
        f"  client CPU max {o.client_max:.3g} s < {CLIENT_SECONDS_TARGET:g} s: "
        f"{verdict(o.client_max < CLIENT_SECONDS_TARGET)}"
    )
    most = max(o.client_bytes)
    lines.append(
        f"  client bytes max {_si(most, 'B')} < {_si(CLIENT_BYTES_TARGET, 'B')} besides the "
        f"masked vector ({_si(o.masked_bytes, 'B')}): {verdict(most < CLIENT_BYTES_TARGET)}"
    )
    if p is None:
        lines.append("  against Flower: not run")
        return lines
    extrap = " (Flower's server extrapolated)" if p.extrapolated else ""
    lines.append(
        f"  client CPU flwr / ours {_ratio(p.client_mean, o.client_mean)} >= 1: "
        f"{verdict(p.client_mean >= o.client_mean)}"
    )
    lines.append(
        f"  client bytes flwr / ours {_ratio(p.bytes_mean, o.bytes_mean)} >= 1: "
        f"{verdict(p.bytes_mean >= o.bytes_mean)}"
    )
    lines.append(
        f"  server CPU flwr / ours {_ratio(p.server_seconds, o.server_seconds)} >= "
        f"{SERVER_SPEEDUP_TARGET:g}{extrap}: "
        f"{verdict(p.server_seconds >= SERVER_SPEEDUP_TARGET * o.server_seconds)}"
    )
    return lines


def settings_of(args: argparse.Namespace) -> list[Setting]:
    """Every (clients, length, dropout) of the grid, then the extra settings."""
    grid = [
        Setting(n, length, rate)
        for n in args.clients
        for length in args.lengths
        for rate in args.dropouts
    ]
    extra = [Setting(*s) for s in args.extra if Setting(*s) not in grid]
    return grid + extra


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.benchmarks.secagg_bench",
        description="SecAgg+: our secure aggregation against Flower's, side by side.",
    )
    parser.add_argument("--clients", type=list_of(user_count, "clients"), help="100,300,1000")
    parser.add_argument("--lengths", type=list_of(user_count, "lengths"), help="1e3,1e4,1e5")
    parser.add_argument(
        "--dropouts", type=list_of(float, "dropouts"), help="dropout rates of the grid (0.1)"
    )
    parser.add_argument(
        "--no-extra", action="store_true", help="skip the 0%% and 30%% dropout settings"
    )
    parser.add_argument("--repeats", type=user_count, default=1, help="runs per setting (1)")
    parser.add_argument(
        "--peer-budget", type=float, default=300.0,
        help="seconds of projected CPU above which a Flower round is sampled (300)",
    )  # fmt: skip
    parser.add_argument(
        "--peer-sample", type=user_count, default=4, help="devices timed in a sampled round"
    )
    parser.add_argument("--no-peer", action="store_true", help="skip Flower")
    parser.add_argument("--seed", type=int, default=20240601, help="seed of inputs and dropouts")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for key in ("clients", "lengths", "dropouts"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    args.extra = [] if args.no_extra else defaults["extra"]
    for rate in args.dropouts + [s[2] for s in args.extra]:
        if not 0 <= rate < 1:
            parser.error(f"dropout rates must lie in [0, 1), got {rate}")
    return args


def _best(runs: list[Measured]) -> Measured:
    """Of repeated runs: the least server CPU and the least mean client CPU."""
    chosen = min(runs, key=lambda m: m.server_seconds)
    fastest = min(runs, key=lambda m: m.client_mean)
    return Measured(
        client_seconds=fastest.client_seconds, client_bytes=chosen.client_bytes,
        masked_bytes=chosen.masked_bytes, server_seconds=chosen.server_seconds,
        extrapolated=chosen.extrapolated, timed=chosen.timed,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    spec = SecureAggregationSpec()
    status = "skipped (--no-peer)" if args.no_peer else flower_status()
    have_peer = not status.startswith(("unavailable", "skipped"))
    print(
        f"secure aggregation benchmark: SecAgg+ in Z_(2^{MODULUS_BITS}), k and t planned for "
        f"up to {spec.max_dropout:.0%} dropouts (threshold fraction {spec.threshold_fraction:g})"
        f", seed {args.seed}, numpy {np.__version__}"
    )
    print(f"peer flwr: {status}")
    if not have_peer and not args.no_peer:
        print("  peer columns skipped: install the bench extra, pip install -e '.[bench]'")
    print(
        "client s: CPU of one device's four steps (mean over the timed devices); client B: "
        "its bytes sent + received besides the masked vector; x = flwr / ours\n"
    )
    rows: list[Row] = []
    failures: list[str] = []
    print("\n".join(table_lines([])), flush=True)
    for setting in settings_of(args):
        ours_runs: list[Measured] = []
        peer_runs: list[Measured] = []
        parameters = None
        try:
            for repeat in range(args.repeats):
                rng = np.random.default_rng([args.seed, setting.clients, setting.length, repeat])
                inputs = rng.integers(0, 2**QUANTIZATION_BITS, (setting.clients, setting.length))
                dropped = dropped_devices(setting.clients, setting.dropout, rng)
                measured, parameters = run_ours(setting, inputs, dropped, spec)
                ours_runs.append(measured)
                if have_peer:
                    peer_runs.append(
                        run_flower(setting, inputs, dropped, parameters, rng,
                                   args.peer_budget, args.peer_sample)
                    )  # fmt: skip
        except AssertionError as error:
            failures.append(str(error))
            print(f"| {setting.label} | FAIL: {error} |", flush=True)
            continue
        assert parameters is not None
        row = Row(
            setting, parameters.neighbours, parameters.threshold, _best(ours_runs),
            _best(peer_runs) if peer_runs else None,
        )  # fmt: skip
        rows.append(row)
        print(table_lines([row])[-1], flush=True)
    print(
        "\n  flwr mode: full = every device ran its four steps (the sum checked); extrap. = "
        "the timed devices ran them, the server time extrapolated from measured per-device "
        "costs (combined secrets checked). Flower's masked vector is int64 (np.save), ours "
        "base64 of 4-byte words in JSON."
    )
    print()
    print("\n".join(target_lines(rows)))
    print(f"\nfinished in {time.perf_counter() - started:.0f} s")
    for line in failures:
        print(f"  FAIL {line}")
    if not failures:
        print("  Both sums equal the true sums in every full round.")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
