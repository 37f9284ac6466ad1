// qworker dashboard: the only script the pages run (their CSP allows no other). Plain DOM: text
// from jobs is set as text (textContent), never as markup.
"use strict";

function confirmForms() {
  document.querySelectorAll("form.confirm").forEach(function (form) {
    form.addEventListener("submit", function (event) {
      if (!window.confirm(form.dataset.confirm || "Sure?")) event.preventDefault();
    });
  });
}

function setText(id, text) {
  var el = document.getElementById(id);
  if (el) el.textContent = text;
}

function ms(value) {
  if (value >= 1000) return Math.floor(value / 1000) + "s";
  return value + "ms";
}

function followOutput() {
  var out = document.getElementById("output");
  if (!out || !out.classList.contains("live") || !window.EventSource) return;
  var source = new EventSource(out.dataset.events);
  var tokens = parseInt(document.getElementById("tokens").textContent, 10) || 0;
  source.addEventListener("token", function (event) {
    var data = JSON.parse(event.data);
    out.appendChild(document.createTextNode(data.text));
    tokens = data.i + 1;
    setText("tokens", String(tokens));
    var queued = parseInt(out.dataset.queued, 10);  // the event's id is its entry id: <ms>-<n>
    var ttft = document.getElementById("ttft");
    if (ttft && !ttft.textContent && queued) ttft.textContent = ms(parseInt(event.lastEventId, 10) - queued);
    setText("status", "running");
  });
  source.addEventListener("done", function (event) {
    var data = JSON.parse(event.data);
    out.textContent = data.text;
    out.classList.remove("live");
    setText("status", "done");
    setText("finish", data.finish_reason);
    setText("tokens", String(data.completion_tokens));
    setText("ttft", ms(data.ttft_ms));
    setText("total", ms(data.total_ms));
    var cancel = document.getElementById("cancel");
    if (cancel) cancel.disabled = true;
    source.close();
  });
  source.addEventListener("failed", function (event) {
    var data = JSON.parse(event.data);
    out.classList.remove("live");
    setText("status", "error: " + data.code + ": " + data.message);
    source.close();
  });
}

document.addEventListener("DOMContentLoaded", function () {
  confirmForms();
  followOutput();
});
