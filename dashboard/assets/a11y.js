/* Accessible roles and names the Dash components do not set themselves (loaded from assets/ with
 * the page; it only adds attributes, it changes no behaviour):
 * - dcc.Tabs: role=tablist on the tab bar, role=tab with aria-selected on each tab (Enter or Space
 *   selects it, as a click does), role=tabpanel on the content;
 * - text inputs and dropdowns without a label of their own: aria-label from their placeholder or
 *   the nearest label of their column, so a screen reader (or a test) can name every control.
 * The page is rebuilt by callbacks (sign-in, tab switches), so a MutationObserver re-applies it. */
(function () {
  function nameFor(el) {
    if (el.getAttribute("aria-label") || el.getAttribute("aria-labelledby")) return null;
    if (el.id && document.querySelector('label[for="' + CSS.escape(el.id) + '"]')) return null;
    if (el.placeholder) return el.placeholder;
    const col = el.closest(".col, [class*='col-']");
    const label = col && col.querySelector("label");
    return label ? label.textContent.trim() : null;
  }

  function apply() {
    document.querySelectorAll(".tab-container").forEach(function (bar) {
      if (bar.getAttribute("role") !== "tablist") bar.setAttribute("role", "tablist");
      bar.querySelectorAll(":scope > .tab").forEach(function (tab) {
        if (tab.getAttribute("role") !== "tab") {
          tab.setAttribute("role", "tab");
          tab.setAttribute("tabindex", "0");
          tab.addEventListener("keydown", function (e) {
            if (e.key === "Enter" || e.key === " ") { e.preventDefault(); tab.click(); }
          });
        }
        const sel = tab.classList.contains("tab--selected") ? "true" : "false";
        if (tab.getAttribute("aria-selected") !== sel) tab.setAttribute("aria-selected", sel);
      });
    });
    document.querySelectorAll(".tab-content").forEach(function (panel) {
      if (panel.getAttribute("role") !== "tabpanel") panel.setAttribute("role", "tabpanel");
    });
    document.querySelectorAll("input:not([type=hidden]):not([type=checkbox]):not([type=radio]), textarea")
      .forEach(function (el) {
        const name = nameFor(el);
        if (name) el.setAttribute("aria-label", name);
      });
  }

  let queued = false;
  const observer = new MutationObserver(function () {
    if (queued) return;
    queued = true;
    window.requestAnimationFrame(function () { queued = false; apply(); });
  });
  function start() {
    apply();
    observer.observe(document.body, {childList: true, subtree: true, attributes: true, attributeFilter: ["class"]});
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
