"""Modal screens: help, chat settings, rename, edit message, pick one of several."""
