// Control: the saturation switch (wait <-> bail-out), the admin token when writes need one,
// and in the demo the "send a burst" button.

const TOKEN_KEY = "sluice-admin-token";

export function createControl(root) {
  const toggle = root.querySelector("#saturation-switch");
  const tokenInput = root.querySelector("#admin-token");
  const burst = root.querySelector("#burst-button");
  const message = root.querySelector("#control-message");
  let current = null;
  let pending = false;
  let messageTimer = null;

  function say(text, error = false) {
    message.textContent = text;
    message.classList.toggle("error", error);
    clearTimeout(messageTimer);
    messageTimer = setTimeout(() => { message.textContent = ""; }, 6000);
  }

  function show(value) {
    if (!value || pending) return;
    current = value;
    toggle.dataset.value = value;
    toggle.setAttribute("aria-checked", String(value === "bail-out"));
    toggle.title = `In force: ${value}. Click to switch to ${value === "wait" ? "bail-out" : "wait"}.`;
  }

  function headers() {
    const result = { "content-type": "application/json" };
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) result.authorization = `Bearer ${token}`;
    return result;
  }

  async function write(method, url, body) {
    const response = await fetch(url, { method, headers: headers(), body: body && JSON.stringify(body) });
    const answer = await response.json().catch(() => ({}));
    if (response.status === 401) {
      tokenInput.hidden = false;
      tokenInput.focus();
      say("This needs the admin token: type it in the box, then try again.", true);
    } else if (!response.ok) {
      say((answer.error && answer.error.message) || `Refused (${response.status}).`, true);
    }
    return response.ok ? answer : null;
  }

  toggle.addEventListener("click", async () => {
    if (pending || !current) return;
    const next = current === "wait" ? "bail-out" : "wait";
    pending = true;
    toggle.disabled = true;
    try {
      const answer = await write("PUT", "/api/policy", { saturation: next });
      if (answer) {
        pending = false;
        show(answer.saturation);
        say(`Saturated requests now ${answer.saturation === "wait" ? "wait for tokens" : "bail out and route without tokens"}.`);
      }
    } catch (error) {
      say("Could not reach Sluice.", true);
    } finally {
      pending = false;
      toggle.disabled = false;
    }
  });

  root.querySelector("#token-form").addEventListener("submit", (event) => event.preventDefault());
  tokenInput.addEventListener("change", () => {
    if (tokenInput.value) sessionStorage.setItem(TOKEN_KEY, tokenInput.value);
    else sessionStorage.removeItem(TOKEN_KEY);
  });

  burst.addEventListener("click", async () => {
    burst.disabled = true;
    try {
      const answer = await write("POST", "/api/demo/burst");
      if (answer) {
        say(answer.queued
          ? "Burst on its way: watch Tokenization (queue, fallback, saturated) and the Event loop's stalls."
          : "A burst is already on its way.");
      }
    } catch (error) {
      say("Could not reach Sluice.", true);
    } finally {
      setTimeout(() => { burst.disabled = false; }, 1000);
    }
  });

  return (snapshot) => {
    show((snapshot.preprocess || {}).saturation);
    const dashboard = snapshot.dashboard || {};
    burst.hidden = !dashboard.demo;
    if (dashboard.write_needs_token && !sessionStorage.getItem(TOKEN_KEY)) tokenInput.hidden = false;
  };
}
