"""A minimal OpenID Connect provider on loopback, for driving Streamlit's st.login in a browser test: discovery
document, an authorize page where the person types their email (no password: the test plays every person), the token
endpoint (checks the client's secret and the code, returns an RS256 id_token with the nonce) and the JWKS. Authlib's
jose (already in the venv for st.login) signs the tokens. Codes are single-use."""
from __future__ import annotations

import base64
import html
import json
import secrets
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlencode, urlparse

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # authlib.jose's deprecation notice
    from authlib.jose import JsonWebKey, jwt

CLIENT_ID, CLIENT_SECRET = "explorer-test", "explorer-test-secret"


class Provider:
    def __init__(self):
        self.key = JsonWebKey.generate_key("RSA", 2048, is_private=True, options={"kid": "test-key"})
        self.codes: dict[str, dict] = {}  # code -> the grant it stands for
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.issuer = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def metadata_url(self) -> str:
        return f"{self.issuer}/.well-known/openid-configuration"

    def __enter__(self) -> "Provider":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def discovery(self) -> dict:
        return {"issuer": self.issuer, "authorization_endpoint": f"{self.issuer}/authorize",
                "token_endpoint": f"{self.issuer}/token", "jwks_uri": f"{self.issuer}/jwks",
                "response_types_supported": ["code"], "subject_types_supported": ["public"],
                "id_token_signing_alg_values_supported": ["RS256"], "scopes_supported": ["openid", "email", "profile"],
                "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post"]}

    def id_token(self, grant: dict) -> str:
        now = int(time.time())
        claims = {"iss": self.issuer, "sub": grant["email"], "aud": CLIENT_ID, "iat": now, "exp": now + 600,
                  "email": grant["email"], "email_verified": True, "name": grant["email"].split("@")[0]}
        if grant.get("nonce"):
            claims["nonce"] = grant["nonce"]
        return jwt.encode({"alg": "RS256", "kid": "test-key"}, claims, self.key).decode()

    def _handler(self):
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, body: bytes, kind: str, headers: dict | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _json(self, data: dict, code: int = 200) -> None:
                self._send(code, json.dumps(data).encode(), "application/json")

            def do_GET(self):
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                if url.path == "/.well-known/openid-configuration":
                    return self._json(provider.discovery())
                if url.path == "/jwks":
                    return self._json({"keys": [provider.key.as_dict(is_private=False)]})
                if url.path == "/authorize":  # the sign-in page: the person types their email
                    if query.get("client_id") != CLIENT_ID:
                        return self._send(400, b"unknown client", "text/plain")
                    hidden = "".join(f'<input type="hidden" name="{html.escape(k)}" value="{html.escape(v)}">'
                                     for k, v in query.items())
                    page = (f'<html><body><h1>Test provider</h1><form method="post" action="/authorize">{hidden}'
                            '<label>Email <input name="email" aria-label="Email"></label>'
                            '<button type="submit">Continue</button></form></body></html>')
                    return self._send(200, page.encode(), "text/html")
                self._send(404, b"", "text/plain")

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                form = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}
                url = urlparse(self.path)
                if url.path == "/authorize":
                    code = secrets.token_urlsafe(16)
                    provider.codes[code] = {"email": form["email"], "nonce": form.get("nonce"),
                                            "redirect_uri": form["redirect_uri"]}
                    target = form["redirect_uri"] + "?" + urlencode({"code": code, "state": form.get("state", "")})
                    return self._send(302, b"", "text/plain", {"Location": target})
                if url.path == "/token":
                    client_id, secret = form.get("client_id"), form.get("client_secret")
                    if self.headers.get("Authorization", "").startswith("Basic "):
                        client_id, secret = base64.b64decode(self.headers["Authorization"][6:]).decode().split(":", 1)
                    grant = provider.codes.pop(form.get("code", ""), None)
                    if (client_id, secret) != (CLIENT_ID, CLIENT_SECRET) or grant is None \
                            or grant["redirect_uri"] != form.get("redirect_uri"):
                        return self._json({"error": "invalid_grant"}, 400)
                    return self._json({"access_token": secrets.token_urlsafe(16), "token_type": "Bearer",
                                       "expires_in": 600, "id_token": provider.id_token(grant)})
                self._send(404, b"", "text/plain")

        return Handler
