"""Links are data: a URL never makes the server read a file, never injects Markdown, and a run id of another
experiment is named, not drawn. And uploaded traces are checked, capped and kept by content hash."""
import re
import sys

import pytest
from streamlit.testing.v1 import AppTest

from backend import uploads
from tests.conftest import REPO
from tests.sweep import open_page, recorded

HOSTILE = "[click](http://evil.example/x)![img](http://evil.example/i.png)"


def _everything_drawn(at) -> str:
    parts = [e.value for kind in ("markdown", "caption", "warning", "error", "info", "subheader", "title")
             for e in getattr(at, kind)]
    return "\n".join(str(p) for p in parts)


_opened: list[str] = []


def _audit(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].startswith("/etc/"):
        _opened.append(args[0])


sys.addaudithook(_audit)  # audit hooks cannot be removed; this one only records


def test_a_trace_path_in_a_link_reads_nothing():
    _opened.clear()
    at = open_page("pages/paged_attention.py", trace="/etc/passwd")
    assert not at.exception
    shown = [e.value.replace("\\", "") for e in at.error]  # as the reader sees it: escapes removed
    assert any("trace: '/etc/passwd' is not a trace name" in e for e in shown), shown
    assert _opened == [], f"the page opened {_opened}"
    assert "root:" not in _everything_drawn(at)


@pytest.mark.parametrize("page, param", [("pages/runs.py", "run"), ("pages/comm_bandwidth.py", "run"),
                                         ("pages/pipeline.py", "run")])
def test_a_markdown_run_id_is_refused_as_text(page, param):
    at = open_page(page, **{param: HOSTILE})
    assert not at.exception
    assert any("is not a run id" in w.value for w in at.warning)
    assert "evil.example" not in _everything_drawn(at)


def test_escape_leaves_no_markdown_to_act_on():
    from pages.markup import escape

    assert escape(HOSTILE) == r"\[click\](http\://evil.example/x)\!\[img\](http\://evil.example/i.png)"
    assert escape("see www.evil.example, `code`, $x$, <b>") == r"see www\.evil.example, \`code\`, \$x\$, \<b\>"
    assert escape("world_size: 1000 is out of range (allowed: 2..8)") == "world_size: 1000 is out of range (allowed: 2..8)"


def test_another_experiments_run_is_named_and_linked_not_drawn():
    rid = recorded("comm.selftest", {"world_size": "1"})
    at = open_page("pages/collectives.py", run=rid)
    assert not at.exception, at.exception
    shown = [w.value.replace("\\", "") for w in at.warning]
    assert any(f"Run `{rid}` is a run of comm.selftest" in w and f"(runs?run={rid})" in w for w in shown), shown


# --- uploaded traces --------------------------------------------------------------------------------------
CSV = "arrival,prompt_len,output_len\n0,10,5\n3,20,7\n"


def test_a_trace_upload_is_bom_tolerant_and_kept_by_content_hash(tmp_path):
    digest = uploads.save_trace(("\ufeff" + CSV).encode(), tmp_path)
    again = uploads.save_trace(("\ufeff" + CSV).encode(), tmp_path)
    assert digest == again and len(digest) == 64
    trace = uploads.load_trace(digest, tmp_path)
    assert list(zip(trace.arrival.tolist(), trace.prompt_len.tolist(), trace.output_len.tolist())) == [(0, 10, 5), (3, 20, 7)]
    (tmp_path / "traces" / "team.csv").write_text(CSV)
    assert len(uploads.load_trace("team.csv", tmp_path)) == 2


@pytest.mark.parametrize("data, message", [
    (b"x" * (uploads.MAX_BYTES + 1), "bytes (allowed: at most"),
    (("arrival,prompt_len,output_len\n" + "0,1,1\n" * (uploads.MAX_ROWS + 1)).encode(), "rows (allowed: at most"),
    (b"arrival,prompt_len,output_len\n9000000,1,1\n", "arrives at step 9,000,000"),
    (b"\xff\xfe", "not UTF-8"),
    (b"arrival,prompt_len\n0,1\n", "needs integer arrival, prompt_len, output_len"),
])
def test_a_trace_over_the_caps_is_refused_with_the_limit(tmp_path, data, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        uploads.save_trace(data, tmp_path)
    assert not (tmp_path / "traces" / "uploads").exists() or not list((tmp_path / "traces" / "uploads").iterdir())


@pytest.mark.parametrize("name", ["/etc/passwd", "../runs.sqlite", "traces/../../x.csv", "a" * 300, "C:\\x.csv"])
def test_a_trace_name_is_never_a_path(tmp_path, name):
    with pytest.raises(ValueError, match="is not a trace name"):
        uploads.load_trace(name, tmp_path)


OIDC = {"redirect_uri": "http://localhost:8501/oauth2callback", "cookie_secret": "test-only", "client_id": "explorer",
        "client_secret": "test-only", "server_metadata_url": "https://idp.example/.well-known/openid-configuration"}


@pytest.mark.parametrize("signed_in", [False, True])
def test_oidc_sign_in_gates_the_app_and_names_the_user(signed_in, monkeypatch):
    """With an [auth] section (st.login, OIDC), a visitor who is not signed in sees only the sign-in button; a signed-in
    user sees the app and their runs are recorded under their email. The identity provider is not contacted here:
    AppTest seeds st.user as Streamlit does after the provider's callback."""
    monkeypatch.setenv("EXPLORER_ADMINS", "ada@example.org")
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=60)
    at.secrets["auth"] = OIDC
    at.user = {"is_logged_in": True, "email": "ada@example.org"} if signed_in else {"is_logged_in": False}
    at.run()
    assert not at.exception, at.exception
    labels = [b.label for b in at.button]
    if signed_in:
        assert "Sign in" not in labels and "Sign out" in labels
        assert any(c.value == "Signed in as ada@example.org (admin)" for c in at.sidebar.caption)
    else:
        assert labels == ["Sign in"] and [t.value for t in at.title] == ["Sign in"]  # nothing of the app
