// The adapters table (one row per loaded adapter, plus the base model's traffic) and the load form.
// Rows are updated in place on each refresh, so a focused Unload button keeps its focus.

import { describe, postJSON } from "./api.js";
import { formatNumber } from "./linechart.js";

const COLUMNS = ["name", "rank", "targets", "pinned", "slot", "inFlight", "draining", "reqRate", "tokRate", "accept",
  "acceptLen", "action"];

// Speculative decoding's figures of one adapter (/server_info's speculative.adapters entry), or dashes before it drafts.
function acceptance(entry) {
  if (!entry || !entry.num_draft_tokens) return { rate: "—", length: "—" };
  return { rate: `${Math.round(100 * entry.acceptance_rate)} %`, length: formatNumber(entry.mean_accepted_length) };
}

function shortTargets(modules) {
  return (modules ?? []).map((m) => m.replace(/_proj$/, "")).join(" ");
}

function yesNo(value) {
  return value ? "yes" : "no";
}

export class AdapterView {
  // onChange: called after a load or unload succeeded (refresh now rather than at the next tick).
  constructor({ table, form, status, onChange }) {
    this.body = table.tBodies[0];
    this.form = form;
    this.status = status;
    this.onChange = onChange;
    this.rows = new Map(); // name -> {row, cells}
    this.resolverDir = null;
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.load();
    });
  }

  setServer(info) {
    this.resolverDir = info.lora_resolver_dir ?? null;
    // a draft model's server: an adapter may bring its draft adapter (draft_lora_path)
    this.form.querySelector("#load-draft-field").hidden = info.speculative?.method !== "draft_model";
    const hint = this.form.querySelector("#load-hint");
    hint.textContent = this.resolverDir
      ? `A path on the server. Leave it empty to load NAME from the resolver directory ${this.resolverDir} ` +
        "(resolver loads are not pinned)."
      : "A directory on the server holding adapter_config.json and the adapter weights.";
  }

  say(text, isError = false) {
    this.status.textContent = text;
    this.status.classList.toggle("error", isError);
  }

  async load() {
    const name = this.form.elements.name.value.trim();
    const path = this.form.elements.path.value.trim();
    const pinned = this.form.elements.pinned.checked;
    const draft = this.form.elements.draft.value.trim();
    const button = this.form.querySelector("button[type=submit]");
    button.disabled = true;
    this.say(`Loading ${name}…`);
    try {
      if (path) {
        await postJSON("/load_lora_adapter",
          { lora_name: name, lora_path: path, pinned, ...(draft ? { draft_lora_path: draft } : {}) });
      } else if (this.resolverDir && !pinned) {
        // The resolver loads a name the first time a request names it; /tokenize is the cheapest such request.
        await postJSON("/tokenize", { prompt: " ", model: name });
      } else {
        throw new Error(this.resolverDir ? "give a path to load an adapter pinned"
          : "give a path (this server has no --lora-resolver-dir)");
      }
      this.say(`Loaded ${name}.`);
      this.form.elements.path.value = "";
      this.form.elements.draft.value = "";
      this.onChange();
    } catch (error) {
      this.say(describe(error), true);
    } finally {
      button.disabled = false;
    }
  }

  async unload(name, button) {
    button.disabled = true;
    this.say(`Unloading ${name} (its requests in flight finish first)…`);
    try {
      await postJSON("/unload_lora_adapter", { lora_name: name });
      this.say(`Unloaded ${name}.`);
      this.onChange();
    } catch (error) {
      this.say(describe(error), true);
      button.disabled = false;
    }
  }

  // adapters: /lora_adapters' list; rates: name -> {req, tok} per second (null before the second scrape);
  // base: the served model name, shown first with its own traffic; task: what they all serve (a pooling server's
  // embed, rerank or classify is shown beside each name); spec: null when the server does not speculate, else
  // name -> its speculative decoding figures (the base model's under its served name).
  update(adapters, rates, base, task = "generate", spec = null) {
    this.task = task;
    this.body.parentElement.classList.toggle("no-spec", !spec);
    const entries = [{ lora_name: base, isBase: true }, ...adapters];
    const names = new Set(entries.map((a) => a.lora_name));
    for (const [name, { row }] of this.rows) {
      if (!names.has(name)) {
        row.remove();
        this.rows.delete(name);
      }
    }
    entries.forEach((adapter, index) => {
      const { row, cells } = this.rows.get(adapter.lora_name) ?? this.addRow(adapter);
      if (this.body.rows[index] !== row) this.body.insertBefore(row, this.body.rows[index] ?? null);
      const rate = rates.get(adapter.lora_name) ?? { req: null, tok: null };
      cells.reqRate.textContent = formatNumber(rate.req);
      cells.tokRate.textContent = formatNumber(rate.tok);
      const drafted = acceptance(spec?.get(adapter.lora_name));
      cells.accept.textContent = drafted.rate;
      cells.acceptLen.textContent = drafted.length;
      if (adapter.isBase) return;
      cells.rank.textContent = adapter.rank;
      cells.targets.textContent = shortTargets(adapter.target_modules);
      cells.targets.title = (adapter.target_modules ?? []).join(", ");
      cells.pinned.textContent = yesNo(adapter.pinned);
      cells.slot.textContent = adapter.resident_slot ?? "—";
      cells.inFlight.textContent = adapter.requests_in_flight;
      cells.draining.textContent = yesNo(adapter.draining);
      row.classList.toggle("draining", Boolean(adapter.draining));
      cells.path.textContent = adapter.lora_path ?? "(from tensors)";
    });
  }

  addRow(adapter) {
    const row = this.body.insertRow();
    row.dataset.adapter = adapter.lora_name;
    const cells = {};
    for (const column of COLUMNS) {
      cells[column] = document.createElement(column === "name" ? "th" : "td");
      cells[column].className = `col-${column}`;
      row.appendChild(cells[column]);
    }
    cells.name.scope = "row";
    const name = document.createElement("span");
    name.className = "adapter-name";
    name.textContent = adapter.lora_name;
    cells.path = document.createElement("span");
    cells.path.className = "adapter-path";
    cells.name.append(name);
    if (this.task && this.task !== "generate") {
      const tag = document.createElement("span");
      tag.className = "adapter-task";
      tag.textContent = this.task;
      tag.title = `served for ${this.task} (the pooling runner)`;
      cells.name.append(" ", tag);
    }
    cells.name.append(cells.path);
    if (adapter.isBase) {
      row.classList.add("base");
      cells.path.textContent = "base model";
      for (const column of ["rank", "targets", "pinned", "slot", "inFlight", "draining"]) {
        cells[column].textContent = "—";
      }
    } else {
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = "Unload";
      button.setAttribute("aria-label", `Unload ${adapter.lora_name}`);
      button.addEventListener("click", () => this.unload(adapter.lora_name, button));
      cells.action.appendChild(button);
    }
    const entry = { row, cells };
    this.rows.set(adapter.lora_name, entry);
    return entry;
  }
}
