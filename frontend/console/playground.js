// One prompt to several models side by side: the base and any adapters, each streamed into its own pane
// through /v1/completions (Server-Sent Events read from fetch's ReadableStream). With an image (picked or dropped),
// each gets a /v1/chat/completions request whose user message is the image, as a data: URL, then the prompt.

import { call, describe } from "./api.js";

// The built-in demo model (`--model-path demo`) answers prompts of 1-3 short lowercase words followed by " ="
// (tests/demo_tasks.py); on it the playground opens with such a prompt, so the first Run shows what each adapter does.
const DEMO_MODEL_PATH = "demo";
const DEMO_PROMPT = "fresh bread =";

// Yields each `data:` payload of an SSE response, parsed, until `[DONE]`.
async function* sseEvents(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value, { stream: !done });
    const events = buffer.split("\n\n");
    buffer = done ? "" : events.pop();
    for (const event of events) {
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
    if (done) return;
  }
}

export class Playground {
  constructor({ form, targets, panes, status, stop, image }) {
    this.form = form;
    this.image = image; // {input, drop, preview, clear}
    this.imageUrl = null; // the chosen image as a data: URL
    image.input.addEventListener("change", () => this.pickImage(image.input.files[0]));
    image.clear.addEventListener("click", () => this.pickImage(null));
    for (const kind of ["dragenter", "dragover"]) {
      image.drop.addEventListener(kind, (event) => {
        event.preventDefault();
        image.drop.classList.add("dragging");
      });
    }
    image.drop.addEventListener("dragleave", () => image.drop.classList.remove("dragging"));
    image.drop.addEventListener("drop", (event) => {
      event.preventDefault();
      image.drop.classList.remove("dragging");
      this.pickImage(event.dataTransfer.files[0]);
    });
    this.targets = targets; // the <fieldset> of checkboxes
    this.panes = panes;
    this.status = status;
    this.stopButton = stop;
    this.base = null;
    this.controller = null;
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.run();
    });
    stop.addEventListener("click", () => this.controller?.abort());
  }

  // The model the server runs (its --model-path): the demo gets a prompt in its format, unless one was typed already.
  setModel(modelPath) {
    const prompt = this.form.elements.prompt;
    if (modelPath === DEMO_MODEL_PATH && prompt.value === prompt.defaultValue) prompt.value = DEMO_PROMPT;
  }

  // The image to send with the prompt (a File), or none; read as a data: URL and shown.
  async pickImage(file) {
    const { input, preview } = this.image;
    if (!file) {
      this.imageUrl = null;
      input.value = "";
      preview.hidden = true;
      return;
    }
    this.imageUrl = await new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
    preview.querySelector("img").src = this.imageUrl;
    preview.querySelector("figcaption").textContent = `${file.name} (${Math.ceil(file.size / 1024)} KiB)`;
    preview.hidden = false;
  }

  // names: what can answer (the base first, then the adapters); keeps each box's checked state.
  setTargets(base, names) {
    this.base = base;
    const list = this.targets.querySelector(".target-list");
    const existing = new Map([...list.querySelectorAll("input")].map((box) => [box.value, box]));
    const wanted = [base, ...names];
    for (const [name, box] of existing) if (!wanted.includes(name)) box.closest("label").remove();
    wanted.forEach((name, index) => {
      let box = existing.get(name);
      if (!box) {
        const label = document.createElement("label");
        box = document.createElement("input");
        box.type = "checkbox";
        box.name = "target";
        box.value = name;
        box.checked = true; // a new model starts ticked, so a Run compares them all; unticking sticks
        label.append(box, ` ${name}${name === base ? " (base)" : ""}`);
        existing.set(name, box);
      }
      const label = box.closest("label") ?? box.parentElement;
      if (list.children[index] !== label) list.insertBefore(label, list.children[index] ?? null);
    });
  }

  async run() {
    const chosen = [...this.targets.querySelectorAll("input:checked")].map((box) => box.value);
    if (!chosen.length) {
      this.status.textContent = "Pick at least one model to send the prompt to.";
      return;
    }
    const elements = this.form.elements;
    const options = { max_tokens: Number(elements.max_tokens.value), temperature: Number(elements.temperature.value) };
    const request = this.imageUrl === null ? { ...options, prompt: elements.prompt.value } : {
      ...options,
      messages: [{ role: "user", content: [
        { type: "image_url", image_url: { url: this.imageUrl } },
        { type: "text", text: elements.prompt.value },
      ] }],
    };
    this.controller = new AbortController();
    const runButton = this.form.querySelector("button[type=submit]");
    runButton.disabled = true;
    this.stopButton.disabled = false;
    this.panes.replaceChildren();
    this.status.textContent = `Sending to ${chosen.join(", ")}…`;
    const results = await Promise.all(chosen.map((model) => this.stream(model, request, this.addPane(model))));
    this.status.textContent = `Done: ${results.join("; ")}.`;
    runButton.disabled = false;
    this.stopButton.disabled = true;
  }

  addPane(model) {
    const pane = document.createElement("article");
    pane.className = "pane";
    pane.dataset.model = model;
    const heading = document.createElement("h3");
    heading.textContent = model === this.base ? `${model} (base)` : model;
    heading.id = `pane-${this.panes.children.length}`;
    pane.setAttribute("aria-labelledby", heading.id);
    const text = document.createElement("pre");
    text.className = "pane-text";
    text.setAttribute("aria-busy", "true");
    const meta = document.createElement("p");
    meta.className = "pane-meta";
    meta.textContent = "waiting…";
    pane.append(heading, text, meta);
    this.panes.appendChild(pane);
    return { pane, text, meta };
  }

  // Streams one model's answer into its pane; returns a one-line summary for the status region.
  async stream(model, request, { pane, text, meta }) {
    const started = performance.now();
    let firstTokenMs = null;
    let tokens = null;
    let finish = null;
    try {
      const route = request.messages ? "/v1/chat/completions" : "/v1/completions";
      const resp = await call(route, {
        method: "POST", signal: this.controller.signal,
        body: { ...request, model, stream: true, stream_options: { include_usage: true } },
      });
      for await (const chunk of sseEvents(resp)) {
        if (chunk.error) throw new Error(`${chunk.error.code}: ${chunk.error.message}`);
        for (const choice of chunk.choices ?? []) {
          const piece = choice.text ?? choice.delta?.content; // completions' text, chat's delta
          if (piece) {
            firstTokenMs ??= performance.now() - started;
            text.textContent += piece;
          }
          finish = choice.finish_reason ?? finish;
        }
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
      }
      const seconds = (performance.now() - started) / 1000;
      const parts = [`${tokens ?? "?"} tokens in ${seconds.toFixed(2)} s`];
      if (firstTokenMs !== null) parts.push(`first after ${firstTokenMs.toFixed(0)} ms`);
      if (finish) parts.push(`finish: ${finish}`);
      meta.textContent = parts.join(" · ");
      return `${model} ${tokens ?? "?"} tokens`;
    } catch (error) {
      const message = error.name === "AbortError" ? "stopped" : describe(error);
      meta.textContent = message;
      pane.classList.add("failed");
      return `${model} ${message}`;
    } finally {
      text.setAttribute("aria-busy", "false");
    }
  }
}
