// The console's only way out: requests to tally's own /v1 API with the token, which lives in
// sessionStorage alone (gone when the tab closes; never in localStorage, a cookie or an
// address).

const TOKEN_KEY = 'tally.token';

/** How often a read refused with 503 `projection_lagging` (or `overloaded`) is tried again. */
const RETRIES_MAX = 3;

/** The longest wait between tries, whatever `Retry-After` says. */
const RETRY_WAIT_MAX_MS = 5000;

/** The 503 codes that mean "ask again in a moment". */
const RETRIED_CODES = new Set(['projection_lagging', 'overloaded']);

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

/** An answer that was not 2xx, with the API's error code. */
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function errorOf(response) {
  let code = `http_${response.status}`;
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error) {
      code = body.error.code || code;
      message = body.error.message || message;
    }
  } catch {
    // Not JSON: keep the status.
  }
  return new ApiError(response.status, code, message);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * A request to the API: the answer as JSON (or the Response itself with `raw`). A 503 the
 * service asks to retry is retried after its Retry-After, a few times; any other failure
 * throws an ApiError.
 */
export async function api(path, { method = 'GET', body, raw = false } = {}) {
  const headers = { accept: raw ? '*/*' : 'application/json' };
  const secret = token.get();
  if (secret) headers.authorization = `Bearer ${secret}`;
  if (body !== undefined) headers['content-type'] = 'application/json';
  for (let attempt = 0; ; attempt += 1) {
    const response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: 'no-store',
      credentials: 'omit',
    });
    if (response.ok) return raw ? response : response.json();
    const error = await errorOf(response);
    // A token the service no longer accepts: the app signs out, whichever section asked.
    if (response.status === 401) window.dispatchEvent(new CustomEvent('tally:unauthorized', { detail: error }));
    if (response.status === 503 && RETRIED_CODES.has(error.code) && attempt < RETRIES_MAX) {
      const seconds = Number(response.headers.get('retry-after')) || 1;
      await sleep(Math.min(seconds * 1000, RETRY_WAIT_MAX_MS));
      continue;
    }
    throw error;
  }
}

/** A query string from an object, leaving out empty values. */
export function query(parameters) {
  const search = new URLSearchParams();
  for (const [name, value] of Object.entries(parameters)) {
    if (value !== undefined && value !== null && value !== '') search.set(name, String(value));
  }
  const text = search.toString();
  return text ? `?${text}` : '';
}

/** Who the token is: `{token_id, scopes, org_id}`. */
export function whoami() {
  return api('/v1/whoami');
}
