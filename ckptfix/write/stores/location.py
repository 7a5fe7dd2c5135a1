"""Where a URL points, compared by place rather than by text: stores normalise what a URL
says (`s3://b//model` is the prefix `model/`; `gs://` and `gcs://` are one scheme; a Hub
repository is one place at every revision), so an output that overlaps its input must be
found on the normalised forms, or the input is overwritten while it is read.

`output_url` normalises an output URL once, when it is claimed, and refuses what would make
object names other than the URL shows (`.`/`..` segments in any encoding, a query or a
fragment, which would otherwise become part of every object's key)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptfix.core.errors import UsageError
from ckptfix.core.text import redact
from ckptfix.io.urls import climbs_out

_ALIASES = {"gcs": "gs"}
_STORES = ("s3", "gs", "hf")


@dataclass(frozen=True)
class Location:
    """A store (scheme and bucket, or the Hub's repository type and name, case-folded) and
    the path's non-empty segments under it."""

    store: tuple[str, ...]
    path: tuple[str, ...]

    def overlaps(self, other: Location) -> bool:
        """One is the other, or inside it."""
        shared = min(len(self.path), len(other.path))
        return self.store == other.store and self.path[:shared] == other.path[:shared]


def _scheme(url: str) -> tuple[str, str]:
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    return _ALIASES.get(scheme, scheme), rest


def location(url: str) -> Location | None:
    """The place `url` names (None for a URL that names no store place, or cannot be
    parsed: its read fails on its own)."""
    scheme, rest = _scheme(url)
    if scheme not in _STORES:
        return None
    rest = rest.partition("?")[0].partition("#")[0]
    if scheme == "hf":
        return _hub_location(url)
    segments = [segment for segment in rest.split("/") if segment]
    if not segments:
        return None
    return Location((scheme, segments[0].lower()), tuple(segments[1:]))


def _hub_location(url: str) -> Location | None:
    from ckptfix.io.remote_hub import _split, parse_url

    try:
        kind, repo, _revision, inner = _split(parse_url(url))
    except (UsageError, ValueError):
        return None
    folder = tuple(segment for segment in inner.split("/") if segment)
    return Location(("hf", kind, repo.lower()), folder)


def output_url(url: str) -> str:
    """`url` normalised (scheme lower-case, `gcs` as `gs`, no empty segments, no trailing
    slash); a usage error for a query, a fragment or a `.`/`..` segment."""
    shown = redact(url)
    scheme, rest = _scheme(url)
    if scheme not in _STORES:  # no store's: open_store says so
        return url
    if "?" in rest or "#" in rest:
        raise UsageError(
            shown,
            "has a query or a fragment (?… or #…): it would become part of every object's name",
            "drop it: credentials come from the environment, not the URL",
        )
    segments = [segment for segment in rest.split("/") if segment]
    if segments and climbs_out("/".join(segments[1:])):
        raise UsageError(
            shown,
            "has a '.' or '..' segment (in some encoding): the objects would not be where "
            "the URL shows",
            "name the prefix without '.' and '..'",
        )
    return f"{scheme}://" + "/".join(segments)


def overlap(output: str, sources: Sequence[str]) -> str | None:
    """The first of `sources` whose place overlaps the output URL's, if any."""
    place = location(output)
    for source in sources:
        other = location(source)
        if place is not None and other is not None and place.overlaps(other):
            return source
    return None
