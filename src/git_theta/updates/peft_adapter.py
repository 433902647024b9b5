"""PEFT adapters as factors: which tensor each LoRA or IA3 module changes, and how.

Read from an adapter's tensors (``…lora_A[.NAME].weight``, ``lora_B``,
``lora_embedding_A/B``, ``ia3_l``) and its ``adapter_config.json``, following what peft
does when it merges (``merge_and_unload``):

- scale ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``; a module's
  alpha comes from ``alpha_pattern`` when a pattern key matches its name the way peft
  matches (the key is a regular expression that must match the whole name or a
  dot-separated suffix of it; the first such key wins), and its rank is the rank of its
  factors (which is what ``rank_pattern`` gave it);
- ``fan_in_fan_out`` (GPT-2's Conv1D stores the weight as (in, out)): the change is
  ``(B @ A).T``. peft decides this per module type, which an adapter file does not
  record, so both orientations are offered where the shape allows and the one that
  reproduces the file best is kept;
- several named adapters in one file (``lora_A.NAME.weight``, as a PeftModel's own
  state dict holds them): each is offered for the tensors it targets;
- DoRA (``lora_magnitude_vector``) is refused for the module, with a reason: its merge
  divides by the norm of the merged weight, so factors cannot describe it.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from git_theta.errors import UsageError
from git_theta.updates.factor_files import ADAPTER_CONFIG

_LORA = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<emb>embedding_)?A"
    r"(?:\.(?P<adapter>[^.]+))?(?:\.weight)?$"
)
_IA3 = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.ia3_l(?:\.(?P<adapter>[^.]+))?$")
_DORA = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_magnitude_vector"
    r"(?:\.(?P<adapter>[^.]+))?(?:\.weight)?$"
)
_MAX_CONFIG = 1 << 20


def read_config(factors_file: str) -> dict[str, Any]:
    """The ``adapter_config.json`` beside ``factors_file`` ({} when there is none).

    Raises UsageError naming the config when it is not a JSON object.
    """
    from git_theta.files import read_capped

    where = os.path.join(os.path.dirname(factors_file), ADAPTER_CONFIG)
    try:
        data = read_capped(where, _MAX_CONFIG)
    except FileNotFoundError:
        return {}
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        raise UsageError(f"{where}: not JSON; fix or remove it") from None
    if not isinstance(config, dict):
        raise UsageError(f"{where}: not a JSON object; fix or remove it")
    return config


def config_for(config: dict[str, Any], adapter: str | None) -> dict[str, Any]:
    """The settings of one named adapter: a config keyed by adapter names (as a
    PeftModel's ``peft_config``) gives that adapter's, anything else applies to all."""
    if adapter is not None and isinstance(config.get(adapter), dict):
        chosen: dict[str, Any] = config[adapter]
        return chosen
    return config


def pattern_key(patterns: dict[str, Any], module: str) -> str | None:
    """The first key of ``patterns`` that matches ``module`` as peft matches (the whole
    name or a dot-separated suffix, the key read as a regular expression)."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except re.error:
            continue  # peft would fail on it too; such a key matches nothing
    return None


def lora_scale(config: dict[str, Any], module: str, rank: int) -> float:
    """The factor peft multiplies ``B @ A`` by for ``module`` with factors of ``rank``."""
    alphas = config.get("alpha_pattern") or {}
    key = pattern_key(alphas, module) if isinstance(alphas, dict) else None
    alpha = alphas[key] if key is not None else config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or rank <= 0:
        raise UsageError(f"adapter config: lora_alpha {alpha!r} for {module} is not a number")
    if config.get("use_rslora"):
        return float(alpha) / math.sqrt(rank)
    return float(alpha) / rank


class Found:
    """What an adapter says about each tensor: candidate inputs and refusals."""

    def __init__(self) -> None:
        from git_theta.updates.factored import Inputs

        self.candidates: dict[str, list[Inputs]] = {}
        self.refused: dict[str, str] = {}


def read_adapter(
    tensors: dict[str, Any], config: dict[str, Any], found: Found
) -> None:  # tensors: name -> Factor
    """Add the LoRA and IA3 modules among ``tensors`` (name -> Factor) to ``found``."""
    from git_theta.updates.factored import Inputs

    dora = set()
    for key in tensors:
        match = _DORA.match(key)
        if match:
            dora.add((match["module"], match["adapter"]))
    for key, a in tensors.items():
        match = _LORA.match(key)
        if match is None:
            continue
        b = tensors.get(key.replace(f".lora_{match['emb'] or ''}A", f".lora_{match['emb'] or ''}B"))
        if b is None:
            continue
        module, adapter = match["module"], match["adapter"]
        settings = config_for(config, adapter)
        target = f"{module}.weight"
        if (module, adapter) in dora or settings.get("use_dora"):
            found.refused[target] = (
                "DoRA adapters are not stored as factors (the merge divides by the merged "
                "weight's norm); stored as auto would"
            )
            continue
        if len(a.shape) > 2 or len(b.shape) > 2:
            # Conv LoRA: A (r, in, kh, kw), B (out, r, 1, 1); the change is B @ A on the
            # kernel viewed as (out, in * kh * kw). The same bytes, as matrices.
            if len(b.shape) < 2 or any(d != 1 for d in b.shape[2:]) or not a.shape:
                found.refused[target] = (
                    f"LoRA factors {list(b.shape)} x {list(a.shape)} are not a matrix "
                    "product (grouped convolution?); stored as auto would"
                )
                continue
            a = a._replace(shape=(a.shape[0], math.prod(a.shape[1:])))
            b = b._replace(shape=tuple(b.shape[:2]))
        rank = a.shape[0] if a.shape else 0
        if match["emb"]:  # lora_embedding_A is (r, num), B (dim, r): the change is (B @ A).T
            rank = a.shape[0] if len(a.shape) == 2 else 0
            orientations = [True]
        else:
            first = bool(settings.get("fan_in_fan_out"))
            orientations = [first, not first]
        scale = lora_scale(settings, module, rank)
        options = found.candidates.setdefault(target, [])
        for transpose in orientations:
            options.append(Inputs("low-rank", (b, a), scale, transpose=transpose))
    for key, vector in tensors.items():
        match = _IA3.match(key)
        if match is None:
            continue
        module = match["module"]
        settings = config_for(config, match["adapter"])
        first = bool(settings.get("fan_in_fan_out"))
        options = found.candidates.setdefault(f"{module}.weight", [])
        for transpose in (first, not first):
            options.append(Inputs("ia3", (vector,), transpose=transpose, broadcast=True))
        # peft scales the bias of a non-feedforward module by the same vector
        found.candidates.setdefault(f"{module}.bias", []).append(
            Inputs("ia3", (vector,), broadcast=True)
        )
