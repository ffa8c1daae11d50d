"""LLM Systems Explorer: `streamlit run app.py`. Routes to pages/ and shows the device and job queue."""
import streamlit as st

st.set_page_config(page_title="LLM Systems Explorer", page_icon=":material/explore:", layout="wide")

from pages.navigation_guard import route_through_app  # noqa: E402  (after set_page_config)

route_through_app()
from pages import render_log, ui  # noqa: E402
from pages.catalog import SECTIONS  # noqa: E402
from pages.sign_in import current_user, sign_in  # noqa: E402

page = {"page": None, "user": None, "run": st.query_params.get("run")}  # filled in as this script run learns them


def _what_ran() -> dict:
    return page


with render_log.script_run(_what_ran):  # the server's time for this page (EXPLORER_RENDER_LOG; off by default)
    ui.warm_up()  # the first visit starts the server's one-time imports while its visitor signs in
    if not sign_in():  # bound beyond localhost: the server's token, or st.login when configured
        st.stop()
    page["user"] = current_user()
    navigation = st.navigation({
        section: [st.Page(t.file, title=t.title, icon=t.icon, url_path=t.url_path, default=t.file == "pages/home.py")
                  for t in topics]
        for section, topics in SECTIONS.items()
    }, expanded=True)
    page["page"] = navigation.url_path
    ui.sidebar()
    navigation.run()
    page["run"] = st.query_params.get("run")  # a run this script started
