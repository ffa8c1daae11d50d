"""Why this module exists: Streamlit treats a folder named `pages/` beside the entry script as a v1 multipage
app until `st.navigation` has run once in the server process (streamlit/streamlit #9624, #9992). The explorer
keeps the folder (the project's layout names it), so a deep link that is a fresh server's very first request
would run its page file alone: no router, no sidebar, and url paths that differ from file names not found.

Streamlit 1.67 offers no public switch for this (no config option; `st.navigation` clears the flag only once
it has run), so we clear the same class flag `st.navigation` clears (streamlit/commands/navigation.py) and
rerun, which then goes through app.py. If an upgrade removes the flag this raises instead of silently breaking
every deep link, and tests/browser opens a deep link as a fresh server's first request to prove the route.
"""
import streamlit as st


def route_through_app() -> None:
    from streamlit.runtime.pages_manager import PagesManager

    if not hasattr(PagesManager, "uses_pages_directory"):
        raise RuntimeError(f"Streamlit {st.__version__} no longer has PagesManager.uses_pages_directory: "
                           "pages/navigation_guard.py needs updating for this version's pages-folder handling")
    if PagesManager.uses_pages_directory:
        PagesManager.uses_pages_directory = False
        st.rerun()
