"""Theme files: one Textual Theme per TOML file, shipped ones from pagedchat.themes plus the user's own.

A theme file has the Theme fields at the top level (name and primary required, colours as CSS colour strings)
and an optional [variables] table of extra CSS variables. `chat-1`..`chat-8` in [variables] colour the chats in
the memory inspector; themes without them get colours derived from their primary/secondary/accent/... colours.

Everything is checked when the file is read, because Textual only rejects a bad value when the theme is applied,
and then the app is gone: a field or variable that is unknown, of the wrong type or not a value Textual's CSS
accepts makes the file a ThemeFileError naming the field, and load_themes skips it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from textual.color import Color, ColorParseError
from textual.css.errors import StylesheetError
from textual.css.stylesheet import Stylesheet
from textual.css.tokenize import tokenize_values
from textual.css.tokenizer import TokenError
from textual.theme import Theme

from pagedchat.config import tomllib

_COLOURS = ("primary", "secondary", "accent", "foreground", "background", "surface", "panel", "boost",
            "success", "warning", "error")
_NUMBERS = ("luminosity_spread", "text_alpha")
_KNOWN = {"name", "dark", "variables", "ansi", *_COLOURS, *_NUMBERS}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
CHAT_VARIABLES = tuple(f"chat-{i}" for i in range(1, 9))   # pagedchat's own: the chats' colours in the page map
# Every variable a Textual theme sets; a [variables] entry outside these and CHAT_VARIABLES is a typo.
_TEXTUAL_VARIABLES = frozenset(Theme(name="reference", primary="#000000").to_color_system().generate())


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
    if not _NAME.fullmatch(name.strip()):
        # Textual puts the name in a CSS class and in the palette's theme list, which reads it as markup.
        raise ThemeFileError(f"{path.name}: name {name!r} may only hold letters, digits, '-', '_' and '.'")
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
    fields["variables"] = _variables(path, raw.get("variables", {}))
    theme = Theme(**fields)
    try:
        theme.to_color_system().generate()  # catches values Textual would only reject when the theme is applied
    except Exception as exc:
        raise ThemeFileError(f"{path.name}: {exc}") from None
    return theme


def _variables(path: Path, variables) -> dict[str, str]:
    if not isinstance(variables, dict):
        raise ThemeFileError(f"{path.name}: [variables] must be a table of names and strings")
    for key, value in variables.items():
        where = f"{path.name}: [variables] {key}"
        if key not in _TEXTUAL_VARIABLES and key not in CHAT_VARIABLES:
            raise ThemeFileError(f"{where} is not a theme variable (a typo?)")
        if not isinstance(value, str):
            raise ThemeFileError(f"{where} must be a string, not {value!r}")
        if not _tokenizes(value):
            raise ThemeFileError(f"{where} = {value!r} is not a value Textual's CSS can read (a value holds no "
                                 "';', '{', '}', ':' or quotes)")
        if key in CHAT_VARIABLES:
            _colour(path, f"[variables] {key}", value)  # drawn as a Content style, which takes plain colours
        elif _is_text_style(key):
            if not _css_accepts("text-style", key, value):
                raise ThemeFileError(f"{where} = {value!r} is not a text style (like \"bold\", \"underline\", "
                                     "\"none\")")
        elif not _css_accepts("color", key, value):
            raise ThemeFileError(f"{where} = {value!r} is not a colour (like \"#1F6F8B\", \"#1F6F8B 40%\", "
                                 "\"auto 87%\")")
    return dict(variables)


def _is_text_style(variable: str) -> bool:
    return variable.endswith("-style") or variable.endswith("-style-hover")


def _tokenizes(value: str) -> bool:
    """Whether Textual's tokenizer reads the value as it reads every theme variable (Stylesheet.set_variables):
    one it cannot read raises there, from whichever stylesheet parse meets it first, and the app is gone."""
    try:
        tokenize_values({"value": value})
    except TokenError:
        return False
    return True


def _css_accepts(rule: str, variable: str, value: str) -> bool:
    """Whether Textual's CSS parser takes value where the app's stylesheet uses this kind of variable."""
    sheet = Stylesheet(variables={variable: value})
    sheet.add_source(f"Screen {{ {rule}: ${variable}; }}", read_from=("theme", variable))
    try:
        sheet.parse()
    except StylesheetError:  # a parse error, or a value whose tokens end the rule ('}', ';') and break the parser
        return False
    return True


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


def chat_colour(variables: dict[str, str], n: int) -> str:
    """The n-th chat colour, round the theme's list."""
    colours = chat_colours(variables)
    return colours[n % len(colours)]
