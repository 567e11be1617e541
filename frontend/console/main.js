// The console's wiring: ask for a key when the server wants one, then every POLL_MS read /lora_adapters,
// /metrics and /audit_log (and /server_info's speculative decoding figures on a server that speculates) and hand
// them to the adapters table, the playground's target list, the charts and the audit panel.

import { AdapterView } from "./adapters.js";
import { AuditView } from "./audit.js";
import { ApiError, describe, getJSON, getText, keys } from "./api.js";
import { LineChart } from "./linechart.js";
import { Playground } from "./playground.js";
import { byLabel, parsePrometheus, RateTracker, total } from "./prom.js";

const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);

const state = { server: null, timer: null, rates: new RateTracker(), needsKey: false, polling: false, again: false };

const adapters = new AdapterView({
  table: $("adapter-table"), form: $("load-form"), status: $("adapter-status"), onChange: () => refresh(),
});
const audit = new AuditView({ table: $("audit-table"), status: $("audit-status") });
const playground = new Playground({
  form: $("play-form"), targets: $("play-targets"), panes: $("play-panes"), status: $("play-status"),
  stop: $("play-stop"),
  image: { input: $("play-image"), drop: $("play-image-drop"), preview: $("play-image-preview"),
    clear: $("play-image-clear") },
});
const charts = {
  throughput: new LineChart($("chart-throughput"), {
    series: [{ label: "generated tokens/s", color: "#2563eb" }, { label: "prompt tokens/s", color: "#d97706" }],
  }),
  requests: new LineChart($("chart-requests"), {
    series: [{ label: "running", color: "#059669" }, { label: "waiting", color: "#dc2626" }],
  }),
  kv: new LineChart($("chart-kv"), { series: [{ label: "KV cache used", color: "#7c3aed" }], unit: " %", yMax: 100 }),
  adapters: new LineChart($("chart-adapters"), {
    series: [{ label: "loaded", color: "#0891b2" }, { label: "in a device slot", color: "#db2777" },
      { label: "running", color: "#65a30d" }],
  }),
};

// ---- errors and keys --------------------------------------------------------------------------------------

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

function toggleKeyPanel(open) {
  $("key-panel").hidden = !open;
  $("key-toggle").setAttribute("aria-expanded", String(open));
  if (open) $("api-key").focus();
}

$("key-toggle").addEventListener("click", () => toggleKeyPanel($("key-panel").hidden));
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  // An empty field keeps the key in use ("Forget keys" clears them).
  keys.set($("api-key").value.trim() || keys.api, $("admin-key").value.trim() || keys.admin);
  $("api-key").value = "";
  $("admin-key").value = "";
  toggleKeyPanel(false);
  $("key-toggle").focus();
  showError("");
  start();
});
$("key-forget").addEventListener("click", () => {
  keys.set("", "");
  showKeyState();
});

function showKeyState() {
  $("key-state").textContent = keys.api || keys.admin
    ? `In use: ${[keys.api && "API key", keys.admin && "admin key"].filter(Boolean).join(" and ")}.`
    : "No key in use.";
}

// A 401 stops the polling and asks for the key; anything else is shown and polling goes on.
function onFailure(error) {
  if (error instanceof ApiError && error.status === 401) {
    state.needsKey = true;
    clearTimeout(state.timer);
    showError(`${describe(error)} — enter the server's API key.`);
    toggleKeyPanel(true);
    return;
  }
  showError(describe(error));
}

// ---- polling ----------------------------------------------------------------------------------------------

async function health() {
  const pill = $("health");
  try {
    const resp = await fetch("/health");
    const body = await resp.json();
    pill.textContent = resp.ok ? "healthy" : `unhealthy: ${body.reason ?? resp.status}`;
    pill.className = resp.ok ? "pill ok" : "pill bad";
  } catch (error) {
    pill.textContent = `unreachable: ${error.message}`;
    pill.className = "pill bad";
  }
}

function perAdapterRates(samples, seconds) {
  const requests = byLabel(samples, "loraplex_adapter_requests_total", "adapter");
  const tokens = byLabel(samples, "loraplex_adapter_generation_tokens_total", "adapter");
  const out = new Map();
  for (const [name, value] of requests) {
    out.set(name, {
      req: state.rates.rate(`req:${name}`, value, seconds),
      tok: state.rates.rate(`tok:${name}`, tokens.get(name) ?? 0, seconds),
    });
  }
  return out;
}

// Speculative decoding's acceptance per adapter, by the names the table shows; null when the server does not
// speculate. /server_info labels the base model's requests "base".
async function speculation(base) {
  if (!state.server.speculative?.method) return null;
  const info = (await getJSON("/server_info")).speculative;
  return new Map(info.adapters.map((a) => [a.adapter === "base" ? base : a.adapter, a]));
}

function updateCharts(samples, seconds) {
  charts.throughput.push(seconds, [
    state.rates.rate("generated", total(samples, "loraplex_generation_tokens_total"), seconds),
    state.rates.rate("prompt", total(samples, "loraplex_prompt_tokens_total"), seconds),
  ]);
  charts.requests.push(seconds, [total(samples, "vllm:num_requests_running"),
    total(samples, "vllm:num_requests_waiting")]);
  charts.kv.push(seconds, [100 * total(samples, "vllm:kv_cache_usage_perc")]);
  charts.adapters.push(seconds, [total(samples, "loraplex_adapters_loaded"),
    total(samples, "loraplex_adapters_resident"), total(samples, "loraplex_adapters_running")]);
}

async function poll() {
  health();
  try {
    if (!state.server) {
      state.server = await getJSON("/server_info");
      $("model-name").textContent = state.server.served_model_name;
      adapters.setServer(state.server);
      playground.setModel(state.server.model_path);
    }
    const base = state.server.served_model_name;
    const [table, metricsText, spec] = await Promise.all([getJSON("/lora_adapters"), getText("/metrics"),
      speculation(base), audit.refresh()]);
    const seconds = performance.now() / 1000;
    const samples = parsePrometheus(metricsText);
    adapters.update(table.adapters, perAdapterRates(samples, seconds), base, table.task, spec);
    playground.setTargets(base, table.adapters.map((a) => a.lora_name));
    updateCharts(samples, seconds);
    $("updated").textContent = `Updated ${new Date().toLocaleTimeString()}`;
    showError("");
  } catch (error) {
    onFailure(error);
  }
}

// One poll at a time: a refresh asked for during one (after a load) runs right after it.
async function refresh() {
  if (state.polling) {
    state.again = true;
    return;
  }
  clearTimeout(state.timer);
  state.polling = true;
  await poll();
  state.polling = false;
  if (state.again) {
    state.again = false;
    refresh();
  } else if (!state.needsKey) {
    state.timer = setTimeout(refresh, POLL_MS);
  }
}

function start() {
  state.needsKey = false;
  showKeyState();
  refresh();
}

start();
