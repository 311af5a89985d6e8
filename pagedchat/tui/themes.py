"""Theme files: one Textual Theme per TOML file, shipped ones from pagedchat.themes plus the user's own.

A theme file has the Theme fields at the top level (name and primary required, colours as CSS colour strings)
and an optional [variables] table of extra CSS variables. `chat-1`..`chat-8` in [variables] colour the chats in
the memory inspector; themes without them get colours derived from their primary/secondary/accent/... colours.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from textual.color import Color, ColorParseError
from textual.theme import Theme

from pagedchat.config import tomllib

_COLOURS = ("primary", "secondary", "accent", "foreground", "background", "surface", "panel", "boost",
            "success", "warning", "error")
_NUMBERS = ("luminosity_spread", "text_alpha")
_KNOWN = {"name", "dark", "variables", "ansi", *_COLOURS, *_NUMBERS}


class ThemeFileError(ValueError):
    """A theme file that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class ThemeLoad:
    themes: list[Theme]
    errors: list[str]     # one line per skipped file, for a notification


def _colour(path: Path, key: str, value) -> str:
    if not isinstance(value, str):
        raise ThemeFileError(f"{path.name}: {key} must be a colour string like \"#1F6F8B\", not {value!r}")
    try:
        Color.parse(value)
    except ColorParseError:
        raise ThemeFileError(f"{path.name}: {key} = {value!r} is not a colour") from None
    return value


def parse_theme(text: str, path: Path) -> Theme:
    """A Theme from a theme file's text; raises ThemeFileError naming the file and the problem."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ThemeFileError(f"{path.name}: not valid TOML ({exc})") from None
    unknown = set(raw) - _KNOWN
    if unknown:
        raise ThemeFileError(f"{path.name}: unknown key {sorted(unknown)[0]!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ThemeFileError(f"{path.name}: needs a name = \"...\"")
    if "primary" not in raw:
        raise ThemeFileError(f"{path.name}: needs a primary colour")
    fields: dict = {"name": name.strip()}
    for key in _COLOURS:
        if key in raw:
            fields[key] = _colour(path, key, raw[key])
    for key in _NUMBERS:
        if key in raw:
            if not isinstance(raw[key], (int, float)) or isinstance(raw[key], bool):
                raise ThemeFileError(f"{path.name}: {key} must be a number")
            fields[key] = float(raw[key])
    for key in ("dark", "ansi"):
        if key in raw:
            if not isinstance(raw[key], bool):
                raise ThemeFileError(f"{path.name}: {key} must be true or false")
            fields[key] = raw[key]
    variables = raw.get("variables", {})
    if not isinstance(variables, dict) or not all(isinstance(v, str) for v in variables.values()):
        raise ThemeFileError(f"{path.name}: [variables] must map names to strings")
    for key, value in variables.items():
        if key.startswith("chat-"):
            _colour(path, key, value)
    fields["variables"] = dict(variables)
    theme = Theme(**fields)
    try:
        theme.to_color_system().generate()  # catches values Textual would only reject when the theme is applied
    except Exception as exc:
        raise ThemeFileError(f"{path.name}: {exc}") from None
    return theme


def load_theme_file(path: Path) -> Theme:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ThemeFileError(f"{path.name}: cannot read ({exc})") from None
    return parse_theme(text, path)


def builtin_theme_files() -> list[Path]:
    folder = resources.files("pagedchat.themes")
    return sorted(Path(str(p)) for p in folder.iterdir() if p.name.endswith(".toml"))


def load_themes(user_dir: Path | None) -> ThemeLoad:
    """The shipped themes, then the user's (a user theme with a shipped name replaces it). Bad files are skipped."""
    files = builtin_theme_files()
    if user_dir is not None and user_dir.is_dir():
        files += sorted(user_dir.glob("*.toml"))
    themes: dict[str, Theme] = {}
    errors: list[str] = []
    for path in files:
        try:
            theme = load_theme_file(path)
        except ThemeFileError as exc:
            errors.append(f"{exc} ({path.parent})")
            continue
        themes[theme.name] = theme
    return ThemeLoad(list(themes.values()), errors)


def chat_colours(variables: dict[str, str]) -> list[str]:
    """Distinct colours for chats in the page map, from the active theme's CSS variables."""
    explicit = [variables[f"chat-{i}"] for i in range(1, 9) if f"chat-{i}" in variables]
    if len(explicit) >= 4:
        return explicit
    names = ["primary", "accent", "secondary", "success", "warning", "error",
             "primary-lighten-2", "accent-lighten-2", "secondary-lighten-2", "success-lighten-2"]
    return explicit + [variables[n] for n in names if n in variables]
