"""The public API is documented in the Google style: every public callable listed here has a docstring whose
``Args:`` section names each parameter of its signature (``self``/``cls``, ``*args`` and ``**kwargs`` aside; a
class documents its constructor's in its own docstring), and a ``Returns:`` (or ``Yields:``) section when its return
annotation is not ``None``. Reads docstrings and signatures with ``inspect``: no process, nothing saved or loaded.

The lists are explicit: a new public name is added here when it is documented."""

from __future__ import annotations

import importlib
import inspect
import re

import lightning  # noqa: F401  (first, as a Lightning script does: the adapters then import after its registries)
import pytest

# Checked in full: Args naming every parameter, Returns/Yields for a non-None return annotation.
DOCUMENTED = [
    "lightning_recover.lightning.fabric:RecoverStrategy",
    "lightning_recover.lightning.fabric:RecoverStrategy.steps",
    "lightning_recover.lightning.fabric:RecoverStrategy.save_checkpoint",
    "lightning_recover.lightning.fabric:RecoverStrategy.load_checkpoint",
    "lightning_recover.lightning.fabric:RecoverStrategy.all_gather",
    "lightning_recover.lightning.fabric:RecoverStrategy.barrier",
    "lightning_recover.lightning.fabric:RecoverStrategy.broadcast",
    "lightning_recover.lightning.fabric:Step",
    "lightning_recover.lightning.trainer:RecoverTrainerStrategy",
    "lightning_recover.lightning.trainer:RecoverTrainerStrategy.save_checkpoint",
    "lightning_recover.lightning.trainer:RecoverTrainerStrategy.load_checkpoint",
    "lightning_recover.lightning.trainer:RecoverTrainerStrategy.remove_checkpoint",
    "lightning_recover.lightning.checkpoint_io:UringCheckpointIO",
    "lightning_recover.lightning.checkpoint_io:UringCheckpointIO.save_checkpoint",
    "lightning_recover.lightning.checkpoint_io:UringCheckpointIO.load_checkpoint",
    "lightning_recover.lightning.checkpoint_io:UringCheckpointIO.remove_checkpoint",
    "lightning_recover.lightning.checkpoint_io:UringCheckpointIO.teardown",
    "lightning_recover.lightning.checkpoint_io:UringCheckpointIO.restore_into",
    "lightning_recover.lightning.checkpoint_io:UringCheckpointIO.new_engine",
    "lightning_recover.lightning.checkpoint_io:AsyncUringCheckpointIO",
    "lightning_recover.lightning.checkpoint_io:AsyncUringCheckpointIO.save_checkpoint",
    "lightning_recover.lightning.checkpoint_io:AsyncUringCheckpointIO.load_checkpoint",
    "lightning_recover.lightning.checkpoint_io:AsyncUringCheckpointIO.remove_checkpoint",
    "lightning_recover.lightning.checkpoint_io:AsyncUringCheckpointIO.teardown",
    "lightning_recover.lightning.checkpoint_io:AsyncUringCheckpointIO.wait_for_snapshot",
    "lightning_recover.lightning.checkpoint_io:AsyncUringCheckpointIO.wait_until_durable",
    "lightning_recover.lightning.checkpoint_io:AsyncUringCheckpointIO.guard_loads",
    "lightning_recover.lightning.checkpoint_io:AsyncUringCheckpointIO.restore_into",
    "lightning_recover.checkpoint:save",
    "lightning_recover.checkpoint:load",
    "lightning_recover.checkpoint:read_info",
    "lightning_recover.checkpoint:verify_file",
    "lightning_recover.checkpoint:cleanup_stale_temps",
    "lightning_recover.checkpoint:cleanup_dcp_temps",
    "lightning_recover.checkpoint:verify_dcp_checkpoint",
    "lightning_recover.checkpoint:ArchiveInfo",
    "lightning_recover.checkpoint:ArchiveInfo.tensors_of",
    "lightning_recover.checkpoint:CachingSavePlanner",
    "lightning_recover.checkpoint:UringStorageWriter",
    "lightning_recover.checkpoint:UringStorageWriter.wait_for_snapshot",
    "lightning_recover.checkpoint:UringStorageWriter.record_results",
    "lightning_recover.checkpoint:UringStorageWriter.release_collector_after_exchange",
    "lightning_recover.checkpoint:UringStorageReader",
    "lightning_recover.checkpoint:DcpSaver",
    "lightning_recover.checkpoint:DcpSaver.save",
    "lightning_recover.checkpoint:DcpSaver.save_part",
    "lightning_recover.checkpoint:DcpSaver.reset",
    "lightning_recover.checkpoint.dcp.reader:read_dcp_metadata",
    "lightning_recover.checkpoint.dcp.sharded_state:save_sharded",
    "lightning_recover.checkpoint.dcp.sharded_state:load_sharded",
    "lightning_recover.checkpoint.dcp.sharded_state:load_full",
    "lightning_recover.checkpoint.dcp.sharded_state:checkpoint_keys",
    "lightning_recover.checkpoint.dcp.sharded_state:is_dcp_checkpoint",
]

# A docstring, no sections required: methods of torch's or Lightning's interfaces (a line saying what differs),
# properties (documented as attributes) and the error classes users catch.
DESCRIBED = [
    "lightning_recover.lightning.fabric:RecoverStrategy.all_reduce",
    "lightning_recover.lightning.fabric:RecoverStrategy.replica",
    "lightning_recover.lightning.fabric:RecoverStrategy.num_replicas",
    "lightning_recover.lightning.fabric:RecoverStrategy.global_rank",
    "lightning_recover.lightning.fabric:RecoverStrategy.world_size",
    "lightning_recover.lightning.fabric:RecoverStrategy.root_device",
    "lightning_recover.lightning.fabric:Step.stats",
    "lightning_recover.lightning.fabric:Step.loss",
    "lightning_recover.lightning.trainer:RecoverTrainerStrategy.reduce",
    "lightning_recover.lightning.trainer:RecoverTrainerStrategy.checkpoint_io",
    "lightning_recover.lightning.checkpoint_io:AsyncUringCheckpointIO.pending_saves",
    "lightning_recover.lightning.checkpoint_io:AsyncUringCheckpointIO.history",
    "lightning_recover.lightning.checkpoint_io:AsyncUringCheckpointIO.checkpoint_io",
    "lightning_recover.checkpoint:CachingSavePlanner.finish_plan",
    "lightning_recover.checkpoint:UringStorageWriter.stage",
    "lightning_recover.checkpoint:UringStorageWriter.close",
    "lightning_recover.checkpoint:UringStorageWriter.set_up_storage_writer",
    "lightning_recover.checkpoint:UringStorageWriter.prepare_local_plan",
    "lightning_recover.checkpoint:UringStorageWriter.prepare_global_plan",
    "lightning_recover.checkpoint:UringStorageWriter.write_data",
    "lightning_recover.checkpoint:UringStorageWriter.finish",
    "lightning_recover.checkpoint:UringStorageWriter.storage_meta",
    "lightning_recover.checkpoint:UringStorageWriter.snapshot_blocked_s",
    "lightning_recover.checkpoint:UringStorageWriter.staging_allocations",
    "lightning_recover.checkpoint:UringStorageReader.set_up_storage_reader",
    "lightning_recover.checkpoint:UringStorageReader.reset",
    "lightning_recover.checkpoint:UringStorageReader.read_metadata",
    "lightning_recover.checkpoint:UringStorageReader.read_data",
    "lightning_recover.checkpoint.dcp.sharded_state:SafeLoadPlanner",
    "lightning_recover.checkpoint.dcp.sharded_state:SafeEmptyLoadPlanner",
    "lightning_recover.checkpoint:CheckpointCorruptError",
    "lightning_recover.checkpoint:CheckpointIncompleteError",
    "lightning_recover.checkpoint:UnsafeCheckpointError",
    "lightning_recover.checkpoint:AsyncCheckpointError",
    "lightning_recover.checkpoint:DcpSaveError",
    "lightning_recover.checkpoint.dcp.reader:SidecarsMissingError",
]

_SECTION = re.compile(r"^(\w[\w ]*):$")  # "Args:", "Returns:", "Raises:", ...
_ENTRY = re.compile(r"^(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)*)\s*(?:\([^)]*\))?:")  # "name:", "a, b:", "name (int):"


def _resolve(name: str) -> object:
    module, _, path = name.partition(":")
    obj: object = importlib.import_module(module)
    for part in path.split("."):
        # a property as defined (a class's getattr would run it), anything else as getattr gives it
        raw = next((vars(c)[part] for c in getattr(obj, "__mro__", ()) if part in vars(c)), None)
        obj = raw if isinstance(raw, property) else getattr(obj, part)
    return obj


def _own_doc(obj: object) -> str:
    """The object's own docstring (``inspect.getdoc`` would fall back to a base class's)."""
    doc = obj.fget.__doc__ if isinstance(obj, property) and obj.fget else getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if doc else ""


def _sections(doc: str) -> dict[str, list[str]]:
    """Section name -> its lines (dedented by one level), for the sections at the docstring's top level."""
    found: dict[str, list[str]] = {}
    current = None
    for line in doc.splitlines():
        match = _SECTION.match(line)
        if match:
            current = match.group(1)
            found[current] = []
        elif current is not None:
            if line.strip() and not line.startswith(" "):
                current = None  # prose after the sections
            else:
                found[current].append(line)
    return found


def _documented_args(lines: list[str]) -> set[str]:
    indents = [len(line) - len(line.lstrip()) for line in lines if line.strip()]
    if not indents:
        return set()
    level = min(indents)
    names: set[str] = set()
    for line in lines:
        if line.strip() and len(line) - len(line.lstrip()) == level:
            match = _ENTRY.match(line.strip())
            if match:
                names.update(n.strip().lstrip("*") for n in match.group(1).split(","))
    return names


def _signature_of(obj: object) -> inspect.Signature:
    return inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)  # type: ignore[misc]


@pytest.mark.parametrize("name", DOCUMENTED)
def test_public_callable_documents_its_arguments_and_result(name: str) -> None:
    obj = _resolve(name)
    doc = _own_doc(obj)
    assert doc, f"{name} has no docstring"
    sections = _sections(doc)
    signature = _signature_of(obj)
    params = [
        p
        for i, p in enumerate(signature.parameters.values())
        if not (i == 0 and p.name in ("self", "cls"))
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    documented = _documented_args(sections.get("Args", []))
    missing = [p.name for p in params if p.name not in documented]
    assert not missing, f"{name}: the Args: section does not name {missing}"
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    if not takes_any:  # a class with **options documents those options too; otherwise every name is a parameter
        stale = sorted(documented - {p.name for p in signature.parameters.values()})
        assert not stale, f"{name}: Args: names {stale}, which are not parameters"
    if not inspect.isclass(obj):
        returns = signature.return_annotation
        if returns is not inspect.Signature.empty and returns not in ("None", None):
            assert "Returns" in sections or "Yields" in sections, f"{name} returns {returns} but has no Returns:"


@pytest.mark.parametrize("name", DESCRIBED)
def test_public_interface_method_has_a_docstring(name: str) -> None:
    assert _own_doc(_resolve(name)), f"{name} has no docstring"


def test_the_section_parser() -> None:
    doc = inspect.cleandoc(
        """Summary.

        Args:
            a: first.
            b, c: both,
                continued: not an entry.
            d (int): typed.

        Returns:
            Something.
        """
    )
    sections = _sections(doc)
    assert set(sections) == {"Args", "Returns"}
    assert _documented_args(sections["Args"]) == {"a", "b", "c", "d"}
