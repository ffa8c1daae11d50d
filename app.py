"""LLM Systems Explorer: `streamlit run app.py`. Routes to pages/ and shows the device and job queue."""
import streamlit as st

st.set_page_config(page_title="LLM Systems Explorer", page_icon=":material/explore:", layout="wide")

from pages.navigation_guard import route_through_app  # noqa: E402  (after set_page_config)

route_through_app()
from pages import ui  # noqa: E402
from pages.catalog import SECTIONS  # noqa: E402
from pages.sign_in import sign_in  # noqa: E402

if not sign_in():  # bound beyond localhost: the server's token, or st.login when configured
    st.stop()

navigation = st.navigation({
    section: [st.Page(t.file, title=t.title, icon=t.icon, url_path=t.url_path, default=t.file == "pages/home.py")
              for t in topics]
    for section, topics in SECTIONS.items()
}, expanded=True)
ui.sidebar()
navigation.run()
