"""The terminal chat app. Entry point: pagedchat.tui.app.run_app(config) with config from pagedchat.config."""
