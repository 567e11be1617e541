// Every call the console makes: the key its user typed goes in `Authorization: Bearer`, and a failure becomes an
// ApiError carrying the server's own message. Keys live in this tab only (sessionStorage), never on the server.

const API_KEY = "loraplex.apiKey";
const ADMIN_KEY = "loraplex.adminKey";
// The routes --admin-api-key guards (http_server.ADMIN_PATHS).
const ADMIN_PATHS = new Set(["/load_lora_adapter", "/unload_lora_adapter", "/v1/load_lora_adapter",
  "/v1/unload_lora_adapter", "/audit_log"]);

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export const keys = {
  get api() { return sessionStorage.getItem(API_KEY) ?? ""; },
  get admin() { return sessionStorage.getItem(ADMIN_KEY) ?? ""; },
  set(api, admin) {
    for (const [name, value] of [[API_KEY, api], [ADMIN_KEY, admin]]) {
      if (value) sessionStorage.setItem(name, value);
      else sessionStorage.removeItem(name);
    }
  },
};

function headers(path, json) {
  const out = {};
  if (json) out["Content-Type"] = "application/json";
  // Without an admin key the admin routes take the API key, as the server does.
  const key = ADMIN_PATHS.has(path) && keys.admin ? keys.admin : keys.api;
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

// The message a failed response carries: OpenAI-style {error: {message}}, the adapter routes' {error_message},
// or the body as text. Shown to the user as is.
async function failureMessage(resp) {
  const text = await resp.text();
  try {
    const body = JSON.parse(text);
    const message = body?.error?.message ?? body?.error_message ?? body?.reason;
    if (typeof message === "string" && message) return message;
  } catch {
    // not JSON: the text itself
  }
  return text || resp.statusText || "request failed";
}

// fetch with the key; resolves to the Response when it is 2xx, else throws ApiError(status, server's message).
export async function call(path, { method = "GET", body, signal } = {}) {
  const json = body !== undefined;
  const resp = await fetch(path, {
    method, signal, headers: headers(path, json), body: json ? JSON.stringify(body) : undefined,
  });
  if (!resp.ok) throw new ApiError(resp.status, await failureMessage(resp));
  return resp;
}

export async function getJSON(path) {
  return (await call(path)).json();
}

export async function getText(path) {
  return (await call(path)).text();
}

export async function postJSON(path, body) {
  const resp = await call(path, { method: "POST", body });
  const reply = await resp.json();
  // The adapter routes answer 200 only on success, but say so in the body too; trust the body.
  if (reply && reply.success === false) throw new ApiError(resp.status, reply.error_message || "failed");
  return reply;
}

// Text of a failure, for a message region: the status and the server's message as is.
export function describe(error) {
  if (error instanceof ApiError) return `${error.status}: ${error.message}`;
  if (error instanceof TypeError) return `cannot reach the server: ${error.message}`; // fetch's network failure
  return error.message;
}
