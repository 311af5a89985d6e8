"""Theme files: the shipped ones load, broken ones are reported and skipped."""

from pathlib import Path

import pytest
from textual.app import App
from pagedchat.backends.local import LocalBackend
from tui_support import ScriptedEngine, make_config, notices, wait_for

from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.themes import ThemeFileError, builtin_theme_files, chat_colours, load_themes, parse_theme


def test_shipped_themes_are_valid_and_include_dark_and_light():
    loaded = load_themes(None)
    assert loaded.errors == []
    by_name = {t.name: t for t in loaded.themes}
    assert len(builtin_theme_files()) == len(by_name) >= 2
    assert any(t.dark for t in by_name.values()) and any(not t.dark for t in by_name.values())
    for theme in by_name.values():
        for field in ("primary", "secondary", "accent", "background", "surface", "panel", "foreground",
                      "success", "warning", "error"):
            assert getattr(theme, field), (theme.name, field)
        assert len(chat_colours(theme.variables)) == 8


def test_user_themes_add_and_broken_ones_are_skipped(tmp_path):
    (tmp_path / "mine.toml").write_text('name = "mine"\nprimary = "#336699"\ndark = false\n')
    (tmp_path / "broken.toml").write_text('name = "broken"\nprimary = "not-a-colour"\n')
    (tmp_path / "garbage.toml").write_text("this is = = not toml")
    loaded = load_themes(tmp_path)
    names = [t.name for t in loaded.themes]
    assert "mine" in names and "broken" not in names
    assert len(loaded.errors) == 2
    assert any("broken.toml" in e and "not a colour" in e for e in loaded.errors)
    assert any("garbage.toml" in e and "TOML" in e for e in loaded.errors)


@pytest.mark.parametrize("text, message", [
    ('primary = "#fff"', "needs a name"),
    ('name = "x"', "needs a primary"),
    ('name = "x"\nprimary = "#fff"\nshiny = true', "unknown key 'shiny'"),
    ('name = "x"\nprimary = "#fff"\ndark = "yes"', "dark must be true or false"),
    ('name = "x"\nprimary = 3', "colour string"),
    ('name = "x"\nprimary = "#fff"\n[variables]\nchat-1 = "nope"', "chat-1"),
    ('name = "x"\nprimary = "#fff"\n[variables]\ntext-muted = "x"', r"text-muted = 'x' is not a colour"),
    ('name = "x"\nprimary = "#fff"\n[variables]\nfooter-key-foreground = "#12345"', "footer-key-foreground"),
    ('name = "x"\nprimary = "#fff"\n[variables]\nblock-cursor-text-style = "shiny"', "not a text style"),
    ('name = "x"\nprimary = "#fff"\n[variables]\ntext-mutd = "#fff"', "text-mutd is not a theme variable"),
    # Values Textual's CSS tokenizer cannot read (it raised TokenError from the app's constructor), and one it
    # reads but whose '}' ends the rule and breaks the parse.
    ('name = "x"\nprimary = "#fff"\n[variables]\ntext-muted = "#fff {"', "not a value Textual's CSS can read"),
    ('name = "x"\nprimary = "#fff"\n[variables]\ntext-muted = "#fff;"', "not a value Textual's CSS can read"),
    ('name = "x"\nprimary = "#fff"\n[variables]\nlink-style = "bold; x"', "not a value Textual's CSS can read"),
    ('name = "x"\nprimary = "#fff"\n[variables]\ntext-muted = "red}*"', r"text-muted = 'red}\*' is not a colour"),
    ('name = "x"\nprimary = "#fff"\n[variables]\ntext-muted = 3', "text-muted must be a string"),
    ('name = "x"\nprimary = "#fff"\nvariables = 3', r"\[variables\] must be a table"),
    ('name = "x"\nprimary = "#fff"\ntext_alpha = "half"', "text_alpha must be a number"),
    ('name = "[/] x"\nprimary = "#fff"', "may only hold letters, digits"),
])
def test_parse_errors_name_file_and_problem(text, message):
    with pytest.raises(ThemeFileError, match=message):
        parse_theme(text, Path("t.toml"))


def test_colours_fall_back_to_theme_colours():
    app = App()
    variables = app.get_css_variables()
    assert len(chat_colours(variables)) >= 6


def test_every_kind_of_textual_variable_value_is_accepted():
    text = ('name = "x"\nprimary = "#fff"\n[variables]\ntext-muted = "auto 60%"\nlink-background = "initial"\n'
            'input-selection-background = "#5FB3B3 35%"\nlink-style-hover = "bold not underline"\n'
            'block-cursor-text-style = "none"\nchat-1 = "#5FB3B3"\n')
    assert parse_theme(text, Path("t.toml")).variables["text-muted"] == "auto 60%"


@pytest.mark.parametrize("wanted", ["bad", "missing"])
async def test_a_bad_or_missing_theme_in_config_starts_with_the_default_and_says_so(tmp_path, wanted):
    config = make_config(tmp_path, theme=wanted)
    config.user_theme_dir.mkdir(parents=True)
    (config.user_theme_dir / "bad.toml").write_text('name = "bad"\nprimary = "#336699"\n[variables]\n'
                                                    'text-muted = "x"\n')
    app = PagedChatApp(config, backend_factory=lambda progress: LocalBackend(ScriptedEngine([])))
    async with app.run_test(notifications=True) as pilot:
        await wait_for(pilot, lambda: app.sessions, "a chat")
        assert app.theme == "pagedchat-dark" and "bad" not in app.available_themes
        said = notices(app)
        assert any("bad.toml" in n and "text-muted = 'x' is not a colour" in n for n in said), said
        assert any(f"No theme named '{wanted}'; using pagedchat-dark" in n for n in said), said
        await pilot.pause()
