// The webhook against a real local HTTP server: JSON bodies arrive; failing, unreachable and slow endpoints never
// block the caller, failures are logged a bounded number of times, and the URL is never logged.
#include "log/webhook.h"

#include <memory>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/http_server.h"
#include "support/output.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

int count(const std::string& text, const std::string& part) {
  int n = 0;
  for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

}  // namespace

TEST(LogWebhook, PostsJsonBodiesInOrder) {
  test::HttpServer server;
  {
    Webhook webhook(server.url("/api/webhooks/123/secret-token"));
    for (int i = 0; i < 3; ++i) webhook.post({{"event", "step"}, {"step", i}, {"content", "step " + std::to_string(i)}});
    ASSERT_TRUE(server.wait_for(3, 5s));
    for (auto start = Clock::now(); webhook.sent() < 3 && seconds_since(start) < 5;) std::this_thread::sleep_for(10ms);
    EXPECT_EQ(webhook.sent(), 3);
    EXPECT_EQ(webhook.failed(), 0);
  }
  const auto requests = server.requests();
  ASSERT_EQ(requests.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    const auto& r = requests[static_cast<std::size_t>(i)];
    EXPECT_EQ(r.method, "POST");
    EXPECT_EQ(r.path, "/api/webhooks/123/secret-token");
    EXPECT_NE(r.headers.find("content-type: application/json"), std::string::npos) << r.headers;
    const auto body = nlohmann::json::parse(r.body);
    EXPECT_EQ(body["step"], i);
    EXPECT_EQ(body["content"], "step " + std::to_string(i));
  }
}

TEST(LogWebhook, TheDestructorSendsWhatIsStillQueued) {
  test::HttpServer server;
  { Webhook(server.url()).post({{"event", "finish"}}); }  // posted and destroyed at once, as at the end of a run
  ASSERT_EQ(server.requests().size(), 1u);
  EXPECT_EQ(nlohmann::json::parse(server.requests()[0].body)["event"], "finish");
}

TEST(LogWebhook, ServerErrorsAreCountedAndLoggedAFewTimesWithoutTheUrl) {
  test::CapturedLog log;
  test::HttpServer server(500);
  const auto url = server.url("/api/webhooks/999/do-not-print-me");
  {
    WebhookOptions options;
    options.max_warnings = 2;
    Webhook webhook(url, options);
    for (int i = 0; i < 5; ++i) webhook.post({{"i", i}});
    ASSERT_TRUE(server.wait_for(5, 5s));
  }
  const auto text = log.text();
  EXPECT_EQ(count(text, "warning webhook:"), 2) << text;
  EXPECT_NE(text.find("HTTP status 500"), std::string::npos) << text;
  EXPECT_NE(text.find("further webhook failures are not logged"), std::string::npos) << text;
  EXPECT_EQ(text.find("do-not-print-me"), std::string::npos) << text;
  EXPECT_EQ(text.find(std::to_string(server.port())), std::string::npos) << "not even the host and port: " << text;
}

TEST(LogWebhook, UnreachableEndpointNeitherBlocksNorThrows) {
  test::CapturedLog log;
  const auto start = Clock::now();
  {
    Webhook webhook("http://127.0.0.1:" + std::to_string(test::closed_port()) + "/hook");
    for (int i = 0; i < 20; ++i) webhook.post({{"i", i}});
  }
  EXPECT_LT(seconds_since(start), 3.0) << "refused connections fail fast";
  EXPECT_NE(log.text().find("webhook: a notification was not delivered"), std::string::npos);
}

// post() only queues: against a server that holds every request for ten minutes, with a request timeout as long,
// nothing can have been answered or have failed when post() returns, unless post() itself waited for the network.
TEST(LogWebhook, PostReturnsWhileARequestIsInFlight) {
  auto server = std::make_unique<test::HttpServer>(200, 600s);
  WebhookOptions options;
  options.timeout = 600s;
  options.drain_timeout = 0ms;
  Webhook webhook(server->url(), options);
  webhook.post({{"i", 0}});
  ASSERT_TRUE(server->wait_for(1, 30s));  // the first request is with the server, unanswered
  for (int i = 1; i <= 3; ++i) webhook.post({{"i", i}});
  EXPECT_EQ(webhook.sent(), 0);
  EXPECT_EQ(webhook.failed(), 0) << "post() waited for the request in flight";
  server.reset();  // closes the held connection: that request fails, and the queued ones find no server
  for (auto start = Clock::now(); webhook.failed() < 1 && seconds_since(start) < 30;) std::this_thread::sleep_for(10ms);
  EXPECT_GE(webhook.failed(), 1);
}

TEST(LogWebhook, SlowEndpointIsCutOffByTheTimeouts) {
  test::HttpServer server(200, 60s);  // accepts, reads, never answers in time
  WebhookOptions options;
  options.timeout = 300ms;
  options.drain_timeout = 500ms;
  options.queue_capacity = 4;
  const auto start = Clock::now();
  {
    Webhook webhook(server.url(), options);
    for (int i = 0; i < 10; ++i) webhook.post({{"i", i}});
    ASSERT_TRUE(server.wait_for(1, 5s));
    // The destructor waits for at most the request in flight and the drain time, then gives up on the rest.
  }
  EXPECT_LT(seconds_since(start), 2.5);
}

TEST(LogWebhook, AFullQueueDropsTheOldestMessages) {
  test::HttpServer server(200, 500ms);  // answers each request after the client has given up on it
  WebhookOptions options;
  options.timeout = 200ms;
  options.drain_timeout = 0ms;
  options.queue_capacity = 2;
  Webhook webhook(server.url(), options);
  webhook.post({{"i", 0}});
  ASSERT_TRUE(server.wait_for(1, 5s));  // the first is in flight, stuck on the slow server
  for (int i = 1; i <= 5; ++i) webhook.post({{"i", i}});
  EXPECT_EQ(webhook.dropped(), 3) << "5 queued behind the one in flight, 2 fit";
  for (auto start = Clock::now(); webhook.failed() < 1 && seconds_since(start) < 5;) std::this_thread::sleep_for(10ms);
  EXPECT_GE(webhook.failed(), 1) << "the stuck request timed out";
  // What is sent next is the newest: 4 and 5.
  ASSERT_TRUE(server.wait_for(2, 5s));
  EXPECT_EQ(nlohmann::json::parse(server.requests()[1].body)["i"], 4);
}

TEST(LogWebhook, OnlyHttpUrlsAndTheMessageDoesNotRepeatTheUrl) {
  try {
    Webhook webhook("ftp://example.org/secret-token");
    FAIL() << "expected a UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("TRAINER_WEBHOOK_URL"), std::string::npos);
    EXPECT_EQ(std::string(e.what()).find("secret-token"), std::string::npos);
  }
}

}  // namespace trainer
