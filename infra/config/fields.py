"""The field types the sections share: Kubernetes names, durations, resource quantities, and the section base."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DURATION = re.compile(r"^\d+[smhdwy]$")


class Section(BaseModel):
    """A config section: unknown keys are errors, and the validated value never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def dns_label(value: str) -> str:
    """`value` when it is a valid Kubernetes name; raise ValueError saying why not."""
    if len(value) > 63 or not _DNS_LABEL.match(value):
        raise ValueError(
            f"'{value}' is not a valid Kubernetes name (lowercase letters, digits and '-', "
            "starting and ending alphanumeric, at most 63 characters)"
        )
    return value


K8sName = Annotated[str, Field(min_length=1)]
Duration = Annotated[str, Field(pattern=_DURATION.pattern)]
_DURATION_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_seconds(value: str) -> int:
    """A `Duration` ("15m") in seconds."""
    return int(value[:-1]) * _DURATION_SECONDS[value[-1]]


# A Kubernetes resource quantity: a signed decimal number and a suffix,
# binary (Ki..Ei), decimal (n, u, m, "", k..E) or an exponent (e3, E-2).
_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(\d+(\.\d*)?|\.\d+))(?P<suffix>[eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$"
)
_BINARY_SUFFIX = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL_SUFFIX = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_MEBIBYTE = 2**20


def quantity_value(text: str) -> Decimal | None:
    """A Kubernetes quantity's value (cores, bytes), or None when it is not one."""
    match = _QUANTITY.match(text)
    if match is None:
        return None
    number, suffix = Decimal(match["number"]), match["suffix"] or ""
    if suffix in _BINARY_SUFFIX:
        return number * Decimal(1024) ** _BINARY_SUFFIX[suffix]
    exponent = _DECIMAL_SUFFIX[suffix] if suffix in _DECIMAL_SUFFIX else int(suffix[1:])
    try:
        return number.scaleb(exponent)
    except InvalidOperation:
        return None


def whole_cores(cpu: str) -> int:
    """The cores a validated CPU quantity holds, a part counted whole, at least one (threads, workers)."""
    cores = quantity_value(cpu)
    assert cores is not None, cpu  # CpuQuantity (or a literal of ours) validated it
    return max(1, math.ceil(cores))


def _quantity_text(value: Any) -> Any:
    # YAML reads `head_cpu: 2` as a number; Kubernetes takes both.
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _positive_quantity(value: str) -> Decimal:
    amount = quantity_value(value)
    if amount is None or amount <= 0:
        raise ValueError(f"'{value}' is not a positive Kubernetes quantity (such as 2, 500m, 8Gi or 512Mi)")
    return amount


def _cpu_quantity(value: str) -> str:
    _positive_quantity(value)
    return value


def _memory_quantity(value: str) -> str:
    if _positive_quantity(value) < _MEBIBYTE:
        raise ValueError(f"'{value}' is less than 1Mi of memory: 'm' is milli (a thousandth of a byte), 'Mi' is mebi")
    return value


CpuQuantity = Annotated[str, BeforeValidator(_quantity_text), AfterValidator(_cpu_quantity)]
MemoryQuantity = Annotated[str, BeforeValidator(_quantity_text), AfterValidator(_memory_quantity)]
