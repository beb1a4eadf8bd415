// Live updates for the rollout dashboard: the server sends re-rendered, escaped HTML parts
// of the page over server-sent events; this puts them in place. No other logic lives here.
"use strict";
(function () {
  const body = document.body;
  const dot = document.getElementById("live-dot");
  const rawIds = () => {
    const box = document.getElementById("raw-ids");
    if (box) {
      box.checked = body.classList.contains("show-ids");
      box.addEventListener("change", () => body.classList.toggle("show-ids", box.checked));
    }
  };
  rawIds();
  const url = body.dataset.live;
  if (!url || !window.EventSource) return;
  let updates = 0;
  const source = new EventSource(url);
  source.addEventListener("open", () => dot && dot.classList.add("on"));
  source.addEventListener("error", () => dot && dot.classList.remove("on"));
  source.addEventListener("parts", (event) => {
    for (const part of JSON.parse(event.data)) {
      const el = document.getElementById(part.id);
      if (el) el.innerHTML = part.html;  // server-rendered with every value escaped
    }
    updates += 1;
    body.dataset.updates = String(updates);
    rawIds();
  });
  source.addEventListener("done", () => {
    source.close();
    if (dot) dot.classList.remove("on");
    body.dataset.live = "";
  });
})();
