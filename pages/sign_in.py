"""The sign-in gate app.py runs first, and who is signed in. Bound to loopback only: open. With st.login
configured (OIDC): signed-in users. Otherwise the server's token (backend/auth.py), given once as ?token=,
after which a cookie lets the browser back in."""
from __future__ import annotations

import getpass

import streamlit as st
import streamlit.components.v1 as components

from backend import auth
from backend.store import data_dir
from pages import markup


def _oidc() -> bool:
    """Whether Streamlit's own sign-in (st.login) is configured: an [auth] section in secrets.toml."""
    try:
        return "auth" in st.secrets
    except Exception:  # no secrets file at all
        return False


def exposed() -> bool:
    return auth.is_exposed(st.get_option("server.address"))


@st.cache_resource
def server_token() -> str:
    """The server's token, printed once on the server's terminal with the link that signs in."""
    token, path = auth.server_token(data_dir())
    where = f"(kept in {path})" if path else "(from EXPLORER_TOKEN)"
    print(f"LLM Systems Explorer needs its token: open http://<this host>:{st.get_option('server.port')}/?token={token}  "
          f"{where}", flush=True)
    return token


def sign_in() -> bool:
    if _oidc():
        if st.user.is_logged_in:
            return True
        st.title("Sign in")
        st.button("Sign in", type="primary", on_click=st.login)
        return False
    if not exposed():
        return True
    token = server_token()
    proof = auth.session_proof(token)
    if st.session_state.get("signed_in") and st.session_state.get("name"):
        return True
    returning = st.session_state.get("signed_in") or auth.same(st.context.cookies.get(auth.COOKIE, ""), proof)
    if returning and (name := auth.name_from_cookie(st.context.cookies.get(auth.NAME_COOKIE))):
        st.session_state.update(signed_in=True, name=name)
        return True
    given = st.query_params.get("token")
    if given is not None and not auth.same(given, token):
        st.error("That token is not this server's.")
        given = None
    with st.form("sign-in"):
        st.title("Sign in")
        st.write("This server is shared: give your name (your runs are recorded under it) and the token printed where "
                 "the server was started (or open the link with it).")
        typed_name = st.text_input("Your name", max_chars=40, help=auth.NAME_ALLOWED)
        typed = st.text_input("Token", type="password") if given is None and not returning else ""
        submitted = st.form_submit_button("Sign in", type="primary")
    if not submitted:
        return False
    try:
        name = auth.check_name(typed_name)
    except ValueError as err:
        st.error(str(err))
        return False
    if not returning and not auth.same(given if given is not None else typed, token):
        st.error("That token is not this server's.")
        return False
    st.session_state.update(signed_in=True, name=name)
    if "token" in st.query_params:
        del st.query_params["token"]  # out of the address bar and the history
    age = "path=/; max-age=2592000; SameSite=Strict"
    components.html(f"<script>document.cookie = '{auth.COOKIE}={proof}; {age}'; "
                    f"document.cookie = '{auth.NAME_COOKIE}={auth.name_cookie_value(name)}; {age}';</script>", height=0)
    return True


def current_user() -> str:
    """Who is launching runs: the signed-in email with st.login; the token holder; on loopback, this machine's user."""
    if _oidc() and st.user.is_logged_in:
        return st.user.get("email") or st.user.get("name") or "signed-in user"
    if exposed():
        return st.session_state.get("name") or "token holder"
    return getpass.getuser()


def who_is_signed_in() -> None:
    """The sidebar's line on who launches runs from this browser, with sign-out where there is a session to end."""
    st.caption(f"Signed in as {markup.escape(current_user())}" + (" (admin)" if _oidc() and is_admin() else ""))
    if _oidc() and st.user.is_logged_in:
        st.button("Sign out", on_click=st.logout, key="sign-out")


def is_admin() -> bool:
    """With st.login, the emails in EXPLORER_ADMINS; otherwise whoever holds the server's token (as in Jupyter,
    the token is the server's own key) or sits at the machine."""
    return current_user() in auth.admins() if _oidc() else True
