// The audit panel: the server's last adapter operations and refusals (/audit_log), newest first. The route takes
// the admin key; without it the panel says so and the rest of the console goes on.

import { ApiError, describe, getJSON } from "./api.js";

const COLUMNS = ["time", "op", "names", "outcome", "key_id", "client", "duration_ms"];

export class AuditView {
  constructor({ table, status }) {
    this.body = table.tBodies[0];
    this.status = status;
  }

  async refresh() {
    try {
      const { entries } = await getJSON("/audit_log");
      this.render(entries.slice().reverse());
      this.status.textContent = entries.length ? "" : "No adapter operations yet.";
    } catch (error) {
      this.status.textContent = error instanceof ApiError && error.status === 401
        ? "The audit log needs the admin key (or the API key when the server has no admin key)."
        : describe(error);
    }
  }

  render(entries) {
    this.body.replaceChildren(...entries.map((entry) => {
      const row = document.createElement("tr");
      if (entry.outcome !== "ok") row.className = "failed";
      for (const column of COLUMNS) {
        const cell = document.createElement("td");
        const value = entry[column];
        cell.textContent = Array.isArray(value) ? value.join(", ") : String(value ?? "—");
        row.append(cell);
      }
      return row;
    }));
  }
}
