"""Network partitions: find the members that cannot reach each other, keep the largest set that can.

A replica whose host lost the control plane is declared dead by its missing heartbeats. One that
still reaches the control plane but not its peers' data traffic (a NIC or firewall fault on the
data network: an *asymmetric* partition) keeps heartbeating, and every collective and every new
generation's gloo group stalls on it. The heartbeat monitor alone never ends that. This module does:

1. **Suspect** (:class:`PartitionJudge`, run by whoever holds the monitor role): the whole group has
   waited on itself for ``suspect_after`` seconds, i.e. every live process of every live replica is
   in a phase that waits on peers (reduce, decide, regroup, exchange, or building its first group)
   and none made progress. A slow peer does not qualify: it is computing, not waiting. Nor does a
   group whose members wait in a join round: that waits on the control plane, not the data network.
2. **Probe**: the judge opens a round (sealed ``reach/round`` holding its number, the live replicas
   with their incarnations and how many peers each probes; the unsealed counter ``reach/rounds`` only wakes the responders: which round
   is open, and its number, come from the sealed record alone, so a client without the secret who bumps
   or rolls back the counter makes no replica skip a round). Each replica's
   :class:`ReachabilityResponder` (a thread beside the heartbeat, polling that counter once per
   heartbeat interval, and the sealed record at least every ``RECHECK_PERIOD``) probes the other
   members' probe servers, bound to the address their data traffic uses, each within ``probe_timeout``
   (``probes.py``: authenticated, up to ``PROBES_IN_FLIGHT`` at once from one thread), and writes a
   sealed report ``reach/{n}/{r}``: the members it reached and those it found cut (see 3). In a group of
   more than ``SAMPLE_PEERS + 1`` members the first round is a sample: each member probes ``SAMPLE_PEERS``
   others (``probes.round_peers``, rotating with the round's number), so a round that finds no cut,
   which a slow group's stall is, costs ``N x SAMPLE_PEERS`` connections rather than ``N x (N - 1)``; a
   cut found there opens a round of every link at once.
3. **Decide**: once every member reported (or ``report_within`` passed), a link between two members is
   *cut* when either reported the other as cut (no connection: refused, unreachable, timed out, no
   probe server published, or an answer that is not the peer's). Only a cut is evidence of a partition:
   a probe that connected but got no answer in time (a peer starved of CPU or frozen: the kernel completed
   the handshake both ways) and a member that sent no report (its responder starved, the control plane
   slow) say nothing about the network, so a loaded host is never fenced for them. The judge keeps the
   largest set of members with no cut link among them (ties: the smallest replica ids, so any process
   computing it from the same reports picks the same set), and declares every other member dead
   (fencing, as for a missed heartbeat: it applies no further step; its launcher ends it); each has a cut
   link with a kept member. If no link is cut, nothing is fenced (the stall was something else) and no
   new round opens for another ``suspect_after``.
4. The survivors see the deaths at their next check (milliseconds), abandon the stalled group and
   form the next generation without the fenced members. The fenced replica prints why and stops;
   restarted (torchrun agent, launcher), it waits to ask to rejoin until it reaches every live member
   (:func:`wait_until_reachable`), so a host still cut off never stalls the group again.

**Bound** (docs/protocol.md, "Network partitions"; :func:`exclusion_bound`): a member cut off from its
peers is declared dead at most ``suspect_after + report_within + 0.1`` seconds after the last member
started waiting on the others, where ``report_within = (probe_waves + 1) x probe_timeout +
heartbeat_interval_max + 0.25`` and ``probe_waves`` is 1 up to ``PROBES_IN_FLIGHT + 1`` members (one more
per as many again); in a group of more than ``SAMPLE_PEERS + 1``, plus the sampled round's own
``report_within`` when a link it probed is cut (always, for a member cut off from all its peers); a cut
between two members that no sampled round probes is found by a later round (the samples rotate); the embedded
monitor uses ``suspect_after = heartbeat_timeout`` and ``probe_timeout = clamp(heartbeat_timeout / 2,
0.5, 2)``. Typical: ``suspect_after + probe_timeout + one heartbeat interval``.

Everything here goes through a ``dist.Store``-like client and the job's :class:`Sealer`, so the same
judge runs in the embedded coordinator's monitor and in any other backend's monitor.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from lightning_recover.errors import ForgedMessageError
from lightning_recover.protocol.messages import (
    ControlStore,
    Sealer,
    mark_dead,
    peek,
    peek_all,
    read_death,
)
from lightning_recover.protocol.probes import (
    CUT,
    REACHED,
    SAMPLE_PEERS,
    ProbeServer,
    Target,
    probe_all,
    probe_order,
    probe_waves,
    round_peers,
)

# Phases in which a replica's main thread waits on its peers ("start": building the first group, or
# a joiner's). A group all of whose live processes sit in these, without progress, waits on itself.
WAITING_PHASES = frozenset({"reduce", "decide", "regroup", "exchange", "start"})
HEARTBEAT_INTERVAL_MAX = 0.5  # the longest heartbeat interval report_within allows for (seconds)
#: The longest a responder goes without reading the sealed ``reach/round`` when the counter did not move
#: (a counter rolled back by an unauthenticated client delays its answer by at most this).
RECHECK_PERIOD = 0.5


def probe_timeout_for(heartbeat_timeout: float) -> float:
    """The probe timeout the embedded monitor uses: half the heartbeat timeout, within 0.5-2 s."""
    return min(2.0, max(0.5, heartbeat_timeout / 2))


def report_within_for(probe_timeout: float, members: int = 2) -> float:
    """How long the judge waits for the reports of a round of ``members`` once it is open: a member's probes of the
    others (``probe_waves`` probe timeouts: one up to ``PROBES_IN_FLIGHT + 1`` members), one more probe timeout, a
    heartbeat interval before its responder looks, 0.25 s for the store."""
    return (probe_waves(members) + 1) * probe_timeout + HEARTBEAT_INTERVAL_MAX + 0.25


def exclusion_bound(
    suspect_after: float, probe_timeout: float, members: int = 2, sample_peers: int = SAMPLE_PEERS
) -> float:
    """Seconds from "the last member started waiting" to "the cut-off members are declared dead", in a group of
    ``members``; in one of more than ``sample_peers + 1``, for a member with a cut link among those its first
    (sampled) round probes, as one cut off from all its peers has: that round, then a round of every link."""
    rounds = report_within_for(probe_timeout, members)
    if members - 1 > sample_peers:
        rounds += report_within_for(probe_timeout, sample_peers + 1)
    return suspect_after + rounds + 0.1


# ---------------------------------------------------------------------------- the decision


def largest_mutual_set(members: Iterable[int], reached: Mapping[int, Iterable[int]]) -> list[int]:
    """The largest set of ``members`` that all reached each other (``reached[r]``: whom r reached;
    a member absent from ``reached`` sent no report and is in no set). Ties go to the set whose
    sorted ids compare smallest, so every process computing it from the same reports agrees.

    A maximum clique of the mutual-reachability graph (Bron-Kerbosch with pivoting): exponential only
    in the number of missing links, which a partition keeps small."""
    reported = sorted(r for r in set(members) if r in reached)
    seen = {r: set(reached[r]) for r in reported}
    adjacent = {r: {s for s in reported if s != r and s in seen[r] and r in seen[s]} for r in reported}
    best: list[int] = []

    def better(candidate: list[int]) -> bool:
        return len(candidate) > len(best) or (len(candidate) == len(best) and candidate < best)

    def expand(chosen: set[int], candidates: set[int], excluded: set[int]) -> None:
        nonlocal best
        if len(chosen) + len(candidates) < len(best):
            return  # cannot beat the best (nor tie it: a tie needs equal size)
        if not candidates and not excluded:
            found = sorted(chosen)
            if better(found):
                best = found
            return
        if not candidates:
            return
        pivot = max(candidates | excluded, key=lambda v: len(adjacent[v] & candidates))
        for v in sorted(candidates - adjacent[pivot]):
            expand(chosen | {v}, candidates & adjacent[v], excluded & adjacent[v])
            candidates = candidates - {v}
            excluded = excluded | {v}

    expand(set(), set(reported), set())
    return best


def partition_verdict(alive: Iterable[int], cut: Mapping[int, Iterable[int]]) -> tuple[list[int], dict[int, list[int]]]:
    """A round's decision: ``(keep, fenced)``. ``cut[r]``: the members r reported as cut (no connection); a
    member absent from ``cut`` sent no report. A link is cut when either end reported it; ``keep`` is the
    largest set of ``alive`` members with no cut link among them (:func:`largest_mutual_set`'s tie rule),
    ``fenced[r]`` the kept members each other alive member has a cut link with (never empty: a member with
    no cut link to a kept one would enlarge the set)."""
    members = sorted(set(alive))
    links_cut: dict[int, set[int]] = {r: set() for r in members}
    for r, reported in cut.items():
        for s in reported if r in links_cut else ():
            if s in links_cut and s != r:
                links_cut[r].add(s)
                links_cut[s].add(r)
    connected = {r: [s for s in members if s != r and s not in links_cut[r]] for r in members}
    keep = largest_mutual_set(members, connected)
    fenced = {r: sorted(links_cut[r] & set(keep)) for r in members if r not in keep}
    return keep, fenced


def cut_evidence(reports: Mapping[int, Mapping], fenced: int, kept: Iterable[int]) -> list[str]:
    """What the members' reports say about each cut link between ``fenced`` and the ``kept`` members, one line per
    end that reported it (``"replica 0 -> 1: connect to ... timed out after 0.5s"``): the operator's evidence."""
    lines = []
    for s in kept:
        for a, b in ((s, fenced), (fenced, s)):
            report = reports.get(a, {})
            if b in report.get(CUT, []):
                lines.append(f"replica {a} -> {b}: {(report.get('why') or {}).get(str(b), 'cut')}")
    return lines


# ---------------------------------------------------------------------------- the probe


def data_address(coordinator_addr: str) -> str:
    """The address this process's gloo traffic uses, as gloo picks it: ``GLOO_SOCKET_IFNAME``'s IPv4
    address if set, else this host name's address, else (that is loopback while the coordinator is
    not) the address of the route to the coordinator."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        return _interface_ipv4(ifname)
    first = coordinator_addr.split("://", 1)[-1].split(",")[0]  # HOST:PORT, or an etcd URL's first member
    coord_host = first.rpartition(":")[0].strip("[]")
    try:
        mine = socket.gethostbyname(socket.gethostname())
    except OSError:
        mine = ""
    if mine and not (ipaddress.ip_address(mine).is_loopback and not _is_loopback(coord_host)):
        return mine
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent: routing only
        s.connect((coord_host, 9))
        return s.getsockname()[0]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _interface_ipv4(ifname: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
        except OSError as exc:
            raise OSError(
                f"GLOO_SOCKET_IFNAME={ifname}: this host has no IPv4 address on that interface ({exc.strerror}). "
                "HINT: name the interface of the network between the replicas (see `ip -4 addr`)."
            ) from None
    return socket.inet_ntoa(packed[20:24])


def _read_sealed_json(store, sealer: Sealer, key: str) -> dict | None:
    """A sealed JSON object at ``key`` of a raw store, or None if absent, forged or malformed; never waits
    (a key deleted between a check and a get would stall a waiting read)."""
    return _open_sealed_json(sealer, key, peek(store, key))


def _open_sealed_json(sealer: Sealer, key: str, raw: bytes | None) -> dict | None:
    try:
        value = json.loads(sealer.open(key, raw)) if raw is not None else None
    except (ForgedMessageError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _open_round(store: ControlStore, recent: bool = False) -> dict:
    """The sealed ``reach/round`` (``{}`` when absent, forged or malformed). ``recent``: on etcd from the watched
    view (the responders read it every ``RECHECK_PERIOD``, and a read through etcd is a Raft proposal, ``peek``'s
    compare-and-set: two writes a second per replica); a stale view only delays an answer by its lag."""
    value = store.recent_genuine("reach/round") if recent else store.get_genuine("reach/round")
    try:
        round_ = json.loads(value) if value else {}
    except ValueError:
        return {}
    return round_ if isinstance(round_, dict) and isinstance(round_.get("round"), int) else {}


# ---------------------------------------------------------------------------- each replica's side


class ReachabilityResponder:
    """A replica's probe server and the thread that answers the judge's rounds (see the module doc)."""

    def __init__(self, store: ControlStore, replica: int, incarnation: int, interval: float) -> None:
        self._store = store.clone()
        self.replica, self.incarnation = replica, incarnation
        self._interval = min(interval, HEARTBEAT_INTERVAL_MAX)  # the judge waits for reports accordingly
        self._server = ProbeServer(data_address(store.addr), store.secret, replica, incarnation)
        self._store.set(
            f"reach/addr/{replica}",
            json.dumps({"inc": incarnation, "host": self._server.host, "port": self._server.port}),
        )
        self._stop = threading.Event()
        self._count = self._store.add("reach/rounds", 0)  # the wake-up counter as last read
        self._answered = int(_open_round(self._store).get("round", 0))  # rounds before this incarnation: not ours
        self._thread = threading.Thread(target=self._run, name=f"lr-reachability-{replica}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pending: int | None = None  # a round we reported in, whose verdict we have not read yet
        checked = time.monotonic()
        while not self._stop.wait(self._interval):
            try:
                latest = self._store.recent_count("reach/rounds")  # a hint: etcd answers from its watched view
                if latest != self._count or time.monotonic() - checked >= RECHECK_PERIOD:
                    self._count, checked = latest, time.monotonic()
                    answered = self._answer_round()
                    pending = answered if answered is not None else pending
                if pending is not None and self._read_verdict(pending):
                    pending = None
            except Exception:
                return  # the control plane is gone: the heartbeat and its watchdog report that

    def _answer_round(self) -> int | None:
        """Answer the open round if it is new and lists this incarnation; its number (None: nothing to answer)."""
        round_ = _open_round(self._store, recent=True)
        n = int(round_.get("round", 0))
        members = {int(r): inc for r, inc in (round_.get("members") or {}).items()}
        if n <= self._answered or members.get(self.replica) != self.incarnation:
            return None  # answered already, or a round this incarnation is not part of
        self._answered = n
        others = round_peers(self.replica, members, int(round_.get("sample") or 0), n)
        outcomes = reach(self._store, others, members, float(round_.get("probe_timeout", 1.0)), self.replica)
        report = {
            "inc": self.incarnation,
            **{kind: sorted(r for r, (o, _) in outcomes.items() if o == kind) for kind in (REACHED, CUT)},
            "why": {str(r): why for r, (o, why) in outcomes.items() if o == CUT},
        }
        self._store.set(f"reach/{n}/{self.replica}", json.dumps(report))
        self._store.append_hint(f"reach/{n}/reported", f"{self.replica},")  # where the judge looks
        return n

    def _read_verdict(self, n: int) -> bool:
        """Once round ``n`` is decided: if it fenced this replica, say why here too (the main thread
        may be blocked in a collective until it notices)."""
        if self._store.get_genuine(f"reach/{n}/verdict") is None:
            return False
        reason = fence_reason(self._store, self.replica, self.incarnation, n)
        if reason:
            print(
                f"[lightning-recover] replica {self.replica}: ReplicaExcludedError: {reason}",
                file=sys.stderr,
                flush=True,
            )
        return True

    def close(self) -> None:
        self._stop.set()
        self._server.close()


def start_responder(
    store: ControlStore, replica: int, incarnation: int, interval: float
) -> ReachabilityResponder | None:
    """This replica's responder; None (said on stderr) where it has no data address to bind."""
    try:
        return ReachabilityResponder(store, replica, incarnation, interval)
    except OSError as exc:  # then a probe round would fence this replica: say why now
        print(f"[lightning-recover] replica {replica}: no partition probes: {exc}", file=sys.stderr, flush=True)
        return None


#: Rounds :func:`fence_reason` looks back over: later rounds may open (among the others, or with this
#: replica's next incarnation) before a fenced incarnation's main thread asks why it was excluded.
_ROUNDS_LOOKED_BACK = 8


def fence_reason(store: ControlStore, replica: int, incarnation: int, number: int | None = None) -> str | None:
    """Why round ``number`` fenced this incarnation (default: the latest of the last few rounds that
    did), or None if it did not."""
    if number is None:
        latest = int(_open_round(store).get("round", 0))  # the sealed number: the counter is only a hint
        for n in range(latest, max(0, latest - _ROUNDS_LOOKED_BACK), -1):
            reason = fence_reason(store, replica, incarnation, n)
            if reason:
                return reason
        return None
    value = store.get_genuine(f"reach/{number}/verdict") if number > 0 else None
    verdict = json.loads(value) if value else {}
    mine = verdict.get("fenced", {}).get(str(replica))
    if mine is None or verdict.get("members", {}).get(str(replica)) != incarnation:
        return None
    lines = mine.get("evidence") or []
    evidence = "; ".join(lines[:3]) + (f"; and {len(lines) - 3} more" if len(lines) > 3 else "")
    return (
        f"has no two-way connection with replicas {_named(mine['unreachable'])} over the data network (a network "
        f"partition{': ' + evidence if evidence else ''}) while replicas {_named(verdict['keep'])} reach each other; it was "
        "fenced and stops, the other replicas continue without it. HINT: check the network between this host and "
        "its peers (firewall rules, NIC, GLOO_SOCKET_IFNAME); restarted by its launcher or torchrun agent, it rejoins "
        "once it reaches them."
    )


def probe_targets(store: ControlStore, replicas: Sequence[int], incarnations: Mapping[int, int]) -> dict[int, Target]:
    """The probe servers of the replicas whose given incarnation published one (``reach/addr/{r}``)."""
    targets = {}
    values = store.genuine_many([f"reach/addr/{r}" for r in replicas])  # one read, not one per replica
    for r, value in zip(replicas, values):
        addr = json.loads(value) if value else None
        if addr and addr.get("inc") == incarnations.get(r):
            targets[r] = Target(r, addr["host"], int(addr["port"]), int(addr["inc"]))
    return targets


def reach(
    store: ControlStore,
    others: Sequence[int],
    incarnations: Mapping[int, int],
    timeout: float,
    me: int | None = None,
) -> dict[int, tuple[str, str]]:
    """Each of ``others``' probe outcome and what happened (``probes.probe_all``, in ``me``'s
    ``probes.probe_order``); :data:`CUT` for a replica whose given incarnation published no probe server
    (``reach/addr/{r}``): nothing can reach it."""
    targets = probe_targets(store, others, incarnations)
    outcomes = {r: (CUT, "it published no probe server") for r in others if r not in targets}
    outcomes.update(_probe_in_order(store, targets, timeout, me))
    return outcomes


def _probe_in_order(
    store: ControlStore, targets: Mapping[int, Target], timeout: float, me: int | None
) -> dict[int, tuple[str, str]]:
    return probe_all([targets[r] for r in probe_order(me, targets)], store.secret, timeout)


def wait_until_reachable(
    store: ControlStore, replica: int, num_replicas: int, timeout: float, job_over: Callable[[], bool]
) -> None:
    """A restarted replica, before asking to rejoin: wait until it reaches every live member that runs a
    probe server (a host still cut off from its peers would only stall the group's next generation
    until it is fenced again)."""
    said = None
    while not job_over():
        others = [r for r in range(num_replicas) if r != replica]
        incs = {r: int(v) for r, v in zip(others, store.call(store.raw.multi_get, [f"inc/{r}" for r in others]))}
        deaths = store.deaths(others)
        live = {r: inc for r, inc in incs.items() if inc > deaths[r]}
        targets = probe_targets(store, sorted(live), live)  # a live member with no probe server is not waited for
        outcomes = _probe_in_order(store, targets, timeout, replica)
        missing = sorted(r for r, (outcome, _) in outcomes.items() if outcome != REACHED)
        if not missing:
            return
        if missing != said:
            said = missing
            print(
                f"[lightning-recover] replica {replica}: waits to rejoin until it reaches replicas {missing} over the "
                "data network (a network partition)",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(timeout)


# ---------------------------------------------------------------------------- the monitor's side


def waits_on_its_data_network(heartbeats: Iterable[dict]) -> bool:
    """Whether a group whose live processes last told these ``heartbeats`` waits on its data network: every one
    in a phase that waits on peers (:data:`WAITING_PHASES`) and none in a join round (``"joining"``). A round
    waits on the control plane (joins written to the store), which a cut data link does not stall; probing it
    would cost every member a connection to every other while the round fills (N^2 at the job's start)."""
    return all(hb.get("phase") in WAITING_PHASES and not hb.get("joining") for hb in heartbeats)


class _OpenRound(NamedTuple):
    number: int
    members: dict[int, int]  # replica -> incarnation
    opened: float
    sample: int  # peers each member probes (0: all)

    def report_within(self, probe_timeout: float) -> float:
        return report_within_for(probe_timeout, self.sample + 1 if self.sample else len(self.members))


def _named(replicas: Iterable[int]) -> str:
    """Replica ids for a log line: all of a few, else how many and the first ones."""
    ids = sorted(replicas)
    return str(ids) if len(ids) <= 16 else f"{len(ids)} replicas ({', '.join(map(str, ids[:8]))}, ...)"


class PartitionJudge:
    """Run by the monitor: opens probe rounds when the group waits on itself, fences who is cut off.

    ``observe(now, heartbeats)`` is called on every pass of the monitor with the genuine heartbeats
    it just read (``{key: (replica, heartbeat dict)}``); it uses only ``store`` (a raw ``dist.Store``-like
    client: get, set, add, check, compare_set) and ``sealer``."""

    def __init__(
        self,
        store,
        sealer: Sealer,
        suspect_after: float,
        probe_timeout: float,
        log: Callable[[str], None] = print,
        sample_peers: int = SAMPLE_PEERS,
    ) -> None:
        self.store, self.sealer = store, sealer
        self.suspect_after = suspect_after
        self.probe_timeout = probe_timeout
        self.sample_peers = sample_peers  # a larger group's first round: peers each member probes
        self._log = log
        self._moved: dict[str, tuple[int, int, float]] = {}  # hb key -> (incarnation, count, when it last moved)
        self._round: _OpenRound | None = None
        self._quiet_until = 0.0  # no new round before this (after a round that found no partition)

    def observe(self, now: float, heartbeats: Mapping[str, tuple[int, dict]], progressed_at: float = 0.0) -> list[int]:
        """One pass; returns the replicas fenced by it (usually none). ``progressed_at``: when the group was
        last seen to make progress otherwise (a step's commit vouching for its members, ``vouches.py``)."""
        if self._round is not None:
            return self._maybe_decide(now)
        stalled_since = progressed_at  # the last time any process made progress
        for key, (_, hb) in heartbeats.items():
            moved = (int(hb.get("inc", 0)), int(hb.get("count", 0)))
            if self._moved.get(key, (None, None))[:2] != moved:
                self._moved[key] = (*moved, now)
            stalled_since = max(stalled_since, self._moved[key][2])
        if now - stalled_since < self.suspect_after or now < self._quiet_until:
            return []  # someone made progress lately (the usual case: no store read at all)
        if any(int(hb.get("inc", 0)) == 0 for _, hb in heartbeats.values()):
            return []  # a replica has not started yet: the others wait for it at the job's start
        dead = self._deaths({r for r, _ in heartbeats.values()})
        live = {r: int(hb["inc"]) for r, hb in heartbeats.values() if dead.get(r, 0) < int(hb["inc"])}
        if len(live) < 2 or not waits_on_its_data_network([hb for r, hb in heartbeats.values() if r in live]):
            return []
        # A large group first probes a sample of links (sample_peers per member); only a cut found there costs
        # every link, which a sound verdict needs (the largest set with no cut link among its members).
        sample = self.sample_peers if len(live) - 1 > self.sample_peers else 0
        self._open(
            live,
            now,
            sample,
            f"every live replica {_named(live)} waited on the others for {now - stalled_since:.2f}s without "
            "progress: probing their data network",
        )
        return []

    def _open(self, live: dict[int, int], now: float, sample: int, why: str) -> None:
        # The number after both the counter and the last sealed round: a counter rolled back or pushed on by an
        # unauthenticated client neither reuses a number nor hides the round (responders read the sealed one).
        last = _read_sealed_json(self.store, self.sealer, "reach/round") or {}
        number = max(int(self.store.add("reach/rounds", 0)), int(last.get("round", 0) or 0)) + 1
        key = "reach/round"
        members = {str(r): inc for r, inc in sorted(live.items())}
        body = json.dumps({"round": number, "members": members, "probe_timeout": self.probe_timeout, "sample": sample})
        self.store.set(key, self.sealer.seal(key, body.encode()))
        self.store.add("reach/rounds", 1)
        self._round = _OpenRound(number, live, now, sample)
        self._log(f"[coordinator] {why} (round {number}{f', {sample} peers each' if sample else ''})")

    def _deaths(self, replicas: Iterable[int]) -> dict[int, int]:
        replicas = sorted(set(replicas))
        # Never a waiting read: a dead/{r} deleted by a client without the secret reads as no death.
        raw = peek_all(self.store, [f"dead/{r}" for r in replicas]) if replicas else []
        return {r: read_death(self.sealer, r, v) if v is not None else 0 for r, v in zip(replicas, raw)}

    def _maybe_decide(self, now: float) -> list[int]:
        number, members, opened, sample = self._round
        dead = self._deaths(members)
        alive = {r: inc for r, inc in members.items() if dead[r] < inc}
        waiting = now - opened < self._round.report_within(self.probe_timeout)
        # Which members reported, from the list they append to (one request a pass, not one per member); then
        # their reports in one read. The list is unsealed: a forged entry only makes a report read as missing, and
        # once report_within passed every member's report is read, listed or not (a list overwritten hides none).
        listed = peek(self.store, f"reach/{number}/reported") or b""
        reporters = sorted({int(x) for x in listed.decode(errors="replace").split(",") if x.isdigit()} & set(members))
        if waiting and not set(alive) <= set(reporters):
            return []
        readers = reporters if waiting else sorted(members)
        keys = [f"reach/{number}/{r}" for r in readers]
        reports: dict[int, dict] = {}
        for r, key, raw in zip(readers, keys, peek_all(self.store, keys) if keys else []):
            report = _open_sealed_json(self.sealer, key, raw)
            if report is not None and report.get("inc") == members[r]:
                reports[r] = report
        if set(alive) - set(reports) and waiting:
            return []  # not everyone reported yet
        self._round = None
        cut = {r: [int(s) for s in report.get(CUT, [])] for r, report in reports.items() if r in alive}
        if sample and any(cut.values()):
            self._open(alive, now, 0, f"round {number} found links cut among its samples: probing every link")
            return []
        self._quiet_until = now + self.suspect_after
        if not reports:
            self._log(f"[coordinator] round {number}: no replica reported; nothing decided")
            return []
        keep, fenced = partition_verdict(alive, cut)
        verdict_key = f"reach/{number}/verdict"
        body = json.dumps(
            {
                "keep": keep,
                "fenced": {
                    str(r): {"unreachable": u, "evidence": cut_evidence(reports, r, u)} for r, u in fenced.items()
                },
                "members": {str(r): inc for r, inc in members.items()},
            }
        )
        self.store.set(verdict_key, self.sealer.seal(verdict_key, body.encode()))
        if not fenced:
            heard = {r: {int(s) for s in report.get(REACHED, [])} for r, report in reports.items()}
            probed = {r: set(round_peers(r, members, sample, number)) & set(alive) for r in alive}
            unsure = [r for r in sorted(alive) if not probed[r] <= heard.get(r, set())]
            self._log(
                f"[coordinator] round {number}: no link between replicas is cut (no partition"
                + (f" on the {sample} links each member probed)" if sample else ")")
                + (f"; replicas {_named(unsure)} did not report, or not every answer came, in time" if unsure else "")
            )
            return []
        for r in sorted(fenced):
            inc = alive[r]
            if mark_dead(self.store, self.sealer, r, inc):
                self.store.set(f"declared/{r}", self.sealer.seal(f"declared/{r}", str(inc).encode()))
                evidence = cut_evidence(reports, r, fenced[r])
                more = f"; and {len(evidence) - 3} more in reach/{number}/verdict" if len(evidence) > 3 else ""
                self._log(
                    f"[coordinator] replica {r} (incarnation {inc}) has no two-way connection with replicas "
                    f"{_named(fenced[r])} while replicas {_named(keep)} reach each other "
                    f"(network partition, round {number}, {now - opened:.2f}s after probing began; "
                    f"{'; '.join(evidence[:3])}{more}): declared dead"
                )
        return sorted(fenced)
